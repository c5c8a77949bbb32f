"""The loss the trainer's model returns for a micro-batch: its family's own, summed over tokens.

:func:`install_loss_forward` gives the bare ``*ForCausalLM`` a
``forward(input_ids, labels, position_ids) -> LossSums``: the summed next-token
cross-entropy (the loop divides by the trained tokens of the whole step) and, for a
mixture of experts, the router's load-balancing loss of the micro-batch. Two routes,
chosen from the model's HF config:

* **chunked** (``config.model_type`` in :data:`CHUNKED_MODEL_TYPES`): the backbone,
  then ``lm_head`` and the cross-entropy over chunks of positions, so the fp32 logits
  of the whole micro-batch never exist at once. A family's head does more than
  ``lm_head`` for some families, and a loss that skipped it would train another
  model: :class:`LogitRule` applies what the config says (Gemma 2 and 3
  ``final_logit_softcapping``, Granite ``logits_scaling``, Cohere ``logit_scale``)
  with the same operations, in the same order and dtype, as the family's forward.
  The table holds only families whose ``*ForCausalLM`` is "backbone, ``lm_head``,
  that rule": ``tests/train/test_family_losses.py`` compares each with transformers'
  own ``model(input_ids, labels=...)`` loss, so a family joins the table with a line
  of that test.
* **logits**: any other family goes through its own forward for the logits (exact by
  construction, whatever its head does), then the same summed cross-entropy.

MoE (the config has ``router_aux_loss_coef``: Qwen2/3-MoE, Mixtral, OLMoE, Granite-MoE):
with a coefficient above 0 (:func:`router_aux_coef`) the backbone also returns its
router logits and the forward computes the family's own ``load_balancing_loss_func``
on them (the logits route takes the ``aux_loss`` the family's forward computes). It is
a mean over the micro-batch's positions, as transformers defines it; the loop adds
``coef * aux`` to each micro-batch's loss, as transformers does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # a label without loss (the token cache's and PyTorch's convention)

# Families whose *ForCausalLM is "backbone, lm_head, LogitRule" (each checked against
# transformers' own loss by tests/train/test_family_losses.py).
CHUNKED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text", "granite",
    "cohere", "cohere2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe",
})


class LossConfigError(ValueError):
    """``model.router_aux_loss_coef`` does not fit the model (a user error: exit 2)."""


class LossSums(NamedTuple):
    """What the installed forward returns for one micro-batch."""

    ce: torch.Tensor  # summed next-token cross-entropy over the trained tokens (fp32 scalar)
    aux: Optional[torch.Tensor]  # the router's load-balancing loss (a mean); None without a router loss


@dataclass(frozen=True)
class LogitRule:
    """What a family's ``*ForCausalLM`` does to ``lm_head``'s output before its loss, read from its config.

    No family in transformers 5.24 sets more than one of these; the order is that of
    their forwards all the same.
    """

    multiply: Optional[float] = None  # logit_scale (Cohere, Cohere 2): logits * s
    divide: Optional[float] = None  # logits_scaling (Granite, Granite-MoE): logits / s
    softcap: Optional[float] = None  # final_logit_softcapping (Gemma 2, Gemma 3): tanh(logits / c) * c

    @classmethod
    def of(cls, config: Any) -> "LogitRule":
        """The rule ``config`` asks for (every field None: plain ``lm_head``)."""
        return cls(getattr(config, "logit_scale", None), getattr(config, "logits_scaling", None),
                   getattr(config, "final_logit_softcapping", None))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(frozen=True)
class RouterLoss:
    """The family's ``load_balancing_loss_func`` with the model's expert counts."""

    func: Callable[..., Any]
    num_experts: int
    top_k: int
    gather: Optional[Callable[[Any], Any]] = None  # cp > 1: the whole sequence's router logits from every slice

    @classmethod
    def of(cls, model: nn.Module, gather: Optional[Callable[[Any], Any]] = None) -> Optional["RouterLoss"]:
        """The model's router loss, or None when its modeling module defines none.

        Looked up along the class's MRO: FSDP2 swaps the class for a subclass defined
        in torch, whose module has no such function.
        """
        func = None
        for c in type(model).__mro__:
            func = getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None)
            if func is not None:
                break
        experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
        if func is None or not experts or not top_k:
            return None
        return cls(func, int(experts), int(top_k), gather)

    def __call__(self, router_logits: Any) -> torch.Tensor:
        # Every position counts, padding included: transformers' own rule without an
        # attention mask, which packed batches never have. The logits go in as fp32: under
        # bf16 the family's softmax and mean would otherwise run, and return, in bf16. Under
        # cp each rank computes the loss of the whole sequence (it is no sum over tokens).
        if self.gather is not None:
            router_logits = self.gather(router_logits)
        return _router_loss_tensor(self.func(_as_fp32(router_logits), self.num_experts, self.top_k, None))


def _as_fp32(router_logits: Any) -> Any:
    """The router logits (a tensor, or one per layer) in fp32, differentiably; anything else as it is."""
    if isinstance(router_logits, torch.Tensor):
        return router_logits.float()
    if isinstance(router_logits, (tuple, list)):
        return type(router_logits)(_as_fp32(t) for t in router_logits)
    return router_logits


def _router_loss_tensor(aux: Any) -> torch.Tensor:
    """``aux`` when it is a loss; otherwise the family gave no router logits to train on."""
    if not isinstance(aux, torch.Tensor):
        raise LossConfigError("this model's forward gave no router logits, so there is no load-balancing loss to "
                              "train (transformers returns them for its mixtures of experts). Fix: "
                              "model.router_aux_loss_coef=0")
    return aux


def router_aux_coef(configured: Optional[float], hf_config: Any) -> float:
    """The coefficient of the router's load-balancing loss (``model.router_aux_loss_coef``).

    Args:
        configured: the config's value: None takes the model config's own
            ``router_aux_loss_coef`` (0 for a model without one), 0 turns it off.
        hf_config: the model's transformers config.

    Raises:
        LossConfigError: a negative value, or a positive one for a model without a router loss.
    """
    own = getattr(hf_config, "router_aux_loss_coef", None)
    if configured is None:
        return float(own or 0.0)
    if configured < 0:
        raise LossConfigError(f"model.router_aux_loss_coef={configured}: a coefficient is >= 0 (0 turns the "
                              "router loss off; null takes the model's own). Fix: model.router_aux_loss_coef=null")
    if configured > 0 and own is None:
        raise LossConfigError(f"model.router_aux_loss_coef={configured}, but {hf_config.model_type} has no "
                              "router load-balancing loss in transformers (not a mixture of experts, or one "
                              "balanced without it). Fix: model.router_aux_loss_coef=null")
    return float(configured)


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # A sum, not a mean: a chunk (or a whole micro-batch) without a trained token
    # gives 0 with a graph, where a mean would give 0/0 = NaN.
    return F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy: position ``t`` predicts ``labels[t + 1]``; ``-100`` targets are skipped.

    Args:
        logits: ``[batch, seq, vocab]``.
        labels: ``[batch, seq]``, aligned with the input ids (the shift happens here); or
            ``[batch, seq + 1]``, a sequence slice's labels and the next slice's first (cp > 1).

    Returns:
        A float32 scalar; 0 (with a graph) when no target is trained.
    """
    n = labels.size(1) - 1
    return _cross_entropy_sum(logits[:, :n, :].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def install_loss_forward(model: nn.Module, compile_loss: bool = False, router_loss: bool = False,
                         gather: Optional[Callable[[Any], Any]] = None) -> str:
    """Give the bare model ``forward(input_ids, labels, position_ids) -> LossSums``, by its config's route.

    Args:
        model: a ``*ForCausalLM`` (possibly already FSDP-wrapped: its config is read).
        compile_loss: ``torch.compile`` the chunked route's logit rule and cross-entropy.
        router_loss: also return the router's load-balancing loss (MoE, coefficient above 0).
        gather: cp > 1 (:mod:`.ulysses`): gathers the router logits of the whole sequence, so that
            each rank's router loss is the whole sample's, as with cp = 1.

    Returns:
        The route taken: ``"chunked"`` or ``"logits"``.

    Raises:
        LossConfigError: a router loss under cp > 1 on the logits route (the family's own
            ``aux_loss`` would be its slice's).
    """
    router = RouterLoss.of(model, gather) if router_loss else None
    if model.config.model_type in CHUNKED_MODEL_TYPES and (router is not None or not router_loss):
        install_chunked_loss_forward(model, compile_loss=compile_loss, router=router)
        return "chunked"
    if router_loss and gather is not None:
        raise LossConfigError(f"{model.config.model_type}'s router loss is computed by its own forward, over "
                              "one rank's slice of the sequence under strategy.context_parallel_size > 1, not over "
                              "the sample. Fix: model.router_aux_loss_coef=0, or strategy.context_parallel_size=1")
    install_logits_loss_forward(model, router_loss=router_loss)
    return "logits"


def install_chunked_loss_forward(model: nn.Module, chunk_tokens: int = 8192, compile_loss: bool = False,
                                 router: Optional[RouterLoss] = None) -> None:
    """The chunked route: the backbone, then ``lm_head``, the family's :class:`LogitRule` and the loss per chunk.

    The decoder runs with the packed position ids and ``use_cache=False``: with no
    attention mask and no cache, transformers reads document boundaries from position
    ids that restart at 0 and keeps attention inside each document (sdpa and eager get
    a block-diagonal causal mask, flash attention its variable-length path). Each chunk
    is recomputed in backward (activation-checkpointed) when there is more than one, so
    the fp32 logits of a large vocabulary are never held for the whole micro-batch. The
    override is set on the instance so that ``Module.__call__``, and therefore FSDP's
    root hooks, still wrap it, and parameter names (the checkpoint keys) do not change.

    Every chunk goes through ``lm_head`` even when none of its targets is trained:
    skipping it would leave ``lm_head`` out of this rank's backward and FSDP's gradient
    reduction would wait for it forever.

    Args:
        model: a ``*ForCausalLM`` with its backbone at ``base_model_prefix`` and ``get_output_embeddings``.
        chunk_tokens: positions per chunk (batch * seq positions).
        compile_loss: ``torch.compile`` the logit rule, upcast and cross-entropy, so the fp32
            logits are never written to memory (``lm_head`` stays outside: FSDP's hooks on it
            must not be traced).
        router: the router loss to return beside the cross-entropy (None: none).
    """
    from torch.utils.checkpoint import checkpoint

    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    rule = LogitRule.of(model.config)

    def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _cross_entropy_sum(rule(logits), targets)

    ce = torch.compile(logits_loss) if compile_loss else logits_loss
    extra = {"output_router_logits": True} if router is not None else {}

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ce(head(h), y)

    def forward(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> LossSums:
        out = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        hidden = out.last_hidden_state
        # Position t predicts labels[t + 1]: labels hold one column more than a cp slice (the next one's first).
        hidden = hidden[:, : labels.size(1) - 1, :].reshape(-1, hidden.size(-1))
        targets = labels[:, 1:].reshape(-1)
        total = hidden.new_zeros((), dtype=torch.float32)
        n = hidden.size(0)
        for start in range(0, n, chunk_tokens):
            h, y = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
            if torch.is_grad_enabled() and n > chunk_tokens:
                total = total + checkpoint(chunk_loss, h, y, use_reentrant=False)
            else:
                total = total + chunk_loss(h, y)
        return LossSums(total, router(out.router_logits) if router is not None else None)

    model.forward = forward  # type: ignore[method-assign]


def install_logits_loss_forward(model: nn.Module, router_loss: bool = False) -> None:
    """The logits route: the model's own forward for the logits (its head's processing included), then the sum.

    The full logits are materialised, as with Hugging Face's ``labels=`` loss, but the
    sum and the -100 handling are ours, so every family is normalised the same way by
    the loop. With ``router_loss`` the family's forward computes its ``aux_loss`` too.
    """
    hf_forward = model.forward
    extra = {"output_router_logits": True} if router_loss else {}

    def forward(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> LossSums:
        out = hf_forward(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        aux = _router_loss_tensor(getattr(out, "aux_loss", None)) if router_loss else None
        return LossSums(loss_sum(out.logits, labels), aux)

    model.forward = forward  # type: ignore[method-assign]
