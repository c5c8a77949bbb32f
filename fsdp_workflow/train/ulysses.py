"""Ulysses sequence parallelism (``strategy.context_parallel_size > 1``, ``context_parallel_impl: ulysses``).

Each rank of a ``cp`` group holds a contiguous slice of every packed sample (the
data loader cuts it: :class:`~fsdp_workflow.train.data.RankBatches`), with its own
slice of the position ids, so embeddings, rotary tables, norms, MLPs, experts and
the loss all run on ``seq_len / cp`` positions. Only attention needs the whole
sequence. There, as in DeepSpeed-Ulysses, one all-to-all trades the sequence shard
for a head shard (``[b, h, s/cp, d] -> [b, h/cp, s, d]``), SDPA runs the whole
sequence for ``h/cp`` heads, and a second all-to-all trades back.

The attention is an implementation of our own registered in transformers'
attention-function registry (``AttentionInterface``), so every family whose
attention calls the registry gets it without a change to its classes. Because
the name is not in the mask registry, transformers builds no mask for the local
slice; the mask is built here, once per micro-batch and window, for the whole
sequence and from the whole sequence's position ids, with transformers' own rule
for packed documents (``find_packed_sequence_indices``: a new document wherever a
position does not follow its predecessor), causal, and the layer's sliding window
if it has one. So a packed document attends to itself alone, exactly as with
``cp = 1``.

KV heads: split over ``cp`` when ``cp`` divides them; otherwise each KV head is
repeated ``r = cp / gcd(kv, cp)`` times first (replicated, as DeepSpeed-Ulysses
and its followers do), which needs ``r`` to divide the query heads per KV head
(:func:`~fsdp_workflow.config.rules_topology.kv_replication`; the planner refuses the rest).

The state is this process's one ``cp`` group and the current micro-batch's mask,
kept until the next forward, so a layer recomputed in backward (activation
checkpointing) sees the same mask.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_workflow.config.rules_topology import kv_replication

ATTENTION = "fsdp_workflow_ulysses"  # our name in transformers' AttentionInterface
_ACTIVE: Optional["SequenceShards"] = None  # the cp group of this process (one model per trainer)


class UlyssesError(ValueError):
    """The model asks for an attention feature the Ulysses path does not build (a user error: exit 2)."""


class _Exchange(torch.autograd.Function):
    """All-to-all of equal chunks along dim 0 (chunk ``i`` to rank ``i``); its own adjoint, so backward is the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over the ``cp`` group; backward sums every rank's gradient of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        chunks = grad.reshape(ctx.size, -1, *grad.shape[1:])
        return _all_to_all(chunks, ctx.group).sum(0), None, None


class SequenceShards:
    """This rank's place in its ``cp`` group, and the attention mask of the micro-batch being trained.

    Args:
        group: the ``cp`` process group (``DeviceMesh["cp"]``).
        size: ranks in it.
        rank: this rank's index in it: which slice of each sample it holds.
    """

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self._documents: Optional[torch.Tensor] = None  # [b, s] document index per position (None: one each)
        self._length = 0
        self._masks: dict[Optional[int], Optional[torch.Tensor]] = {}

    def see(self, position_ids: torch.Tensor) -> None:
        """Read the whole sequence's document boundaries from every rank's slice of ``position_ids``."""
        from transformers.masking_utils import find_packed_sequence_indices

        full = _GatherTokens.apply(position_ids.transpose(0, 1), self.group, self.size).transpose(0, 1)
        self._documents = find_packed_sequence_indices(full)
        self._length = full.size(1)
        self._masks = {}

    def mask(self, sliding_window: Optional[int], device: torch.device) -> Optional[torch.Tensor]:
        """``[b, 1, s, s]`` booleans (True: attend) for the whole sequence; None: plain causal (SDPA's ``is_causal``)."""
        if sliding_window not in self._masks:
            if self._documents is None and sliding_window is None:
                self._masks[sliding_window] = None
            else:
                pos = torch.arange(self._length, device=device)
                allowed = pos[None, :] <= pos[:, None]  # [q, kv]: causal
                if sliding_window is not None:
                    allowed = allowed & (pos[None, :] > pos[:, None] - sliding_window)
                allowed = allowed[None]
                if self._documents is not None:
                    docs = self._documents.to(device)
                    allowed = allowed & (docs[:, :, None] == docs[:, None, :])
                self._masks[sliding_window] = allowed[:, None]
        return self._masks[sliding_window]

    def gather_tokens(self, x: Any) -> Any:
        """Router logits (``[tokens, experts]`` per layer) of the whole sequence, differentiably; others as given."""
        if isinstance(x, torch.Tensor):
            return _GatherTokens.apply(x, self.group, self.size)
        if isinstance(x, (tuple, list)):
            return type(x)(self.gather_tokens(t) for t in x)
        return x

    def heads_for_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, h, s/cp, d]`` (this rank's positions, every head) -> ``[b, h/cp, s, d]`` (every position)."""
        b, h, s, d = x.shape
        chunks = x.reshape(b, self.size, h // self.size, s, d).transpose(0, 1)
        got = _Exchange.apply(chunks, self.group)  # [cp: the rank whose positions, b, h/cp, s/cp, d]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * s, d)

    def sequence_for_heads(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`heads_for_sequence`: ``[b, h/cp, s, d] -> [b, h, s/cp, d]``."""
        b, hl, s, d = y.shape
        chunks = y.reshape(b, hl, self.size, s // self.size, d).permute(2, 0, 1, 3, 4)
        got = _Exchange.apply(chunks, self.group)  # [cp: the rank whose heads, b, h/cp, s/cp, d]
        return got.transpose(0, 1).reshape(b, self.size * hl, s // self.size, d)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[b, h, s/cp, d]`` in, ``[b, s/cp, h, d]`` out.

    ``attention_mask`` is None (no mask is built for the local slice) and is ignored:
    the whole sequence's mask comes from :meth:`SequenceShards.mask`.
    """
    shards = _ACTIVE
    if shards is None:
        raise RuntimeError(f"attention '{ATTENTION}' called without a cp group: install() was not run")
    for feature in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(feature) is not None:
            raise UlyssesError(f"this model's attention uses {feature}, which the Ulysses attention (SDPA) does "
                               "not build. Fix: strategy.context_parallel_size=1")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise UlyssesError("the Ulysses attention is built for causal language models only. "
                           "Fix: strategy.context_parallel_size=1")
    heads, kv_heads = query.size(1), key.size(1)
    r = kv_replication(heads, kv_heads, shards.size)
    if r is None:  # the planner refuses this; a model built otherwise than planned gets here
        raise UlyssesError(f"{heads} query heads and {kv_heads} KV heads cannot split over cp {shards.size}. "
                           "Fix: a strategy.context_parallel_size dividing the attention heads")
    if r > 1:  # replicate KV heads (repeat_kv's order) so that every rank gets whole groups
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
    q, k, v = (shards.heads_for_sequence(t) for t in (query, key, value))
    mask = shards.mask(kwargs.get("sliding_window"), q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=mask is None, enable_gqa=k.size(1) != q.size(1))
    return shards.sequence_for_heads(out).transpose(1, 2).contiguous(), None


def install(model: nn.Module, shards: SequenceShards) -> None:
    """Run ``model``'s attention through :func:`ulysses_attention` over ``shards``' group.

    ``model`` already has the loss forward (:func:`fsdp_workflow.train.loss.install_loss_forward`);
    it is wrapped so that each micro-batch's whole-sequence document boundaries are read
    (one all-gather of the position ids) before the backbone runs.
    """
    from transformers import AttentionInterface

    global _ACTIVE
    AttentionInterface.register(ATTENTION, ulysses_attention)
    _ACTIVE = shards
    model.config._attn_implementation = ATTENTION
    inner = model.forward

    def forward(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> Any:
        shards.see(position_ids)
        return inner(input_ids=input_ids, labels=labels, position_ids=position_ids)

    model.forward = forward  # type: ignore[method-assign]
