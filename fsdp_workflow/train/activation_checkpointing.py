"""``strategy.activation_checkpointing``: which decoder-layer activations backward recomputes.

Activation checkpointing trades compute for memory: a wrapped layer keeps only
its input in forward and runs its forward again in backward. The modes, applied
to the bare model before FSDP2 shards it (so the FSDP unit is the wrapper and
its all-gather serves forward, recompute and backward alike):

* ``full``: every decoder layer is wrapped. Least memory, one extra forward.
* ``every_n_layers``: the Nth, 2Nth, ... layer (1-based, as torchtitan counts
  its "selective layer" option) with N = ``strategy.activation_checkpointing_every_n_layers``;
  the other layers keep their activations. Memory and recompute both scale by 1/N.
* ``ops``: every layer is wrapped, but a selective-checkpoint policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) decides op by
  op. Attention outputs (the fused SDPA kernels), a reduce-scatter should one run
  inside a layer, and ``max`` (float8's scales) are kept; of the matmuls, every
  second one of a layer's forward is kept (the 2nd, 4th, ...) and the others run
  again in backward, as do the cheap ops (norms, activation functions, rotary,
  elementwise). In a Llama layer that keeps k, o and up (5.25 h x 2 bytes per
  token) and recomputes q, v and gate: about a third of the layer's forward
  matmul FLOPs, against all of its forward, attention included, for ``full``.
  This is the trade torchtitan's op-level policy makes; it counts from the first
  matmul, we keep the even ones, because the last matmul of a Llama layer
  (down_proj, the 7th) has an output backward never reads, and in eager a kept
  output is held whether or not backward reads it.

Under ``train.compile`` the policy must see the layer's ops as AOTAutograd traces
them: :func:`compile_units` compiles the checkpoint wrapper, not the layer inside
it, so the checkpoint is a region of the compiled graph and the partitioner saves
and recomputes as the policy tags. A layer compiled inside an eager checkpoint is
opaque to the policy (it sees inductor's ``aten.mm.out`` calls, no ``aten.mm``),
so every matmul of it ran again in backward: ``ops`` cost ``full``'s time and more
(38,191 against 38,825 tokens/s on one H100, docs/training.md).

Recomputation runs the same kernels on the same inputs, so every mode gives the
losses and gradients of ``none`` (tests/train/test_activation_checkpointing.py
checks that on 2 gloo ranks with FSDP2; tests/train/test_ac_policy.py counts
which forward ops each mode runs again in backward, eager and compiled). The mode is read from the typed config, never from the environment.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, List, Sequence

import torch
from torch import nn

from fsdp_workflow.config.schema import ActivationCheckpointing


def _ops(names: Iterable[str]) -> frozenset:
    """The ``torch.ops`` overloads named ``namespace.op.overload`` that this torch build has."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


# The linear layers' matmuls: aten mm (3-D inputs are folded to 2-D), addmm (with a
# bias), _scaled_mm (train.float8), or linear where a backend keeps it whole. The
# ``ops`` mode keeps every second one of them.
MATMUL_OPS = _ops([
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_mm.default",
    "aten.linear.default",
])

# Outputs the ``ops`` mode always keeps: attention (the fused SDPA kernels, or bmm when
# SDPA falls back to its math path), a reduce-scatter, and max, the absolute maximum
# float8 scales by (a scalar: keeping it costs nothing and the recompute casts alike).
ALWAYS_SAVED_OPS = _ops([
    "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten.max.default",
    "_c10d_functional.reduce_scatter_tensor.default",
])


class _EverySecondMatmul:
    """The ``ops`` policy of one checkpointed call of a layer (a fresh one per call).

    Matmuls are counted in the order forward runs them and the 2nd, 4th, ... are kept.
    torch 2.13 asks the policy in forward only; earlier releases ask again while
    recomputing (``ctx.is_recompute``), so each pass counts on its own.
    """

    def __init__(self) -> None:
        self.matmuls = {False: 0, True: 0}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        if op in MATMUL_OPS:
            self.matmuls[ctx.is_recompute] += 1
            keep = self.matmuls[ctx.is_recompute] % 2 == 0
        else:
            keep = op in ALWAYS_SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _ops_context() -> Any:
    """The ``context_fn`` of ``ops`` (a module-level function: torch.compile takes it as a constant)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_EverySecondMatmul())


def layers_to_wrap(num_layers: int, mode: ActivationCheckpointing, every_n_layers: int) -> List[int]:
    """The 0-based indices of the decoder layers ``mode`` checkpoints.

    Args:
        num_layers: decoder layers in the model, in forward order.
        mode: ``strategy.activation_checkpointing``.
        every_n_layers: ``strategy.activation_checkpointing_every_n_layers`` (read by ``every_n_layers`` only).

    Returns:
        The indices, ascending; empty for ``none``.
    """
    if mode == ActivationCheckpointing.none:
        return []
    if mode == ActivationCheckpointing.every_n_layers:
        return [i for i in range(num_layers) if (i + 1) % every_n_layers == 0]
    return list(range(num_layers))


def apply_activation_checkpointing(model: nn.Module, layer_classes: Sequence[type],
                                   mode: ActivationCheckpointing, every_n_layers: int) -> List[int]:
    """Wrap the decoder layers ``mode`` chooses in torch's non-reentrant ``CheckpointWrapper``, in place.

    Call it on the bare model, before ``fully_shard`` (and after tensor parallelism).

    Args:
        model: the bare model.
        layer_classes: the decoder layer classes (``model.decoder_layer_cls`` resolved).
        mode: ``strategy.activation_checkpointing``.
        every_n_layers: ``strategy.activation_checkpointing_every_n_layers``.

    Returns:
        The 0-based indices of the layers wrapped (for the run's log).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as wrap_modules,
        checkpoint_wrapper,
    )

    layers = [m for m in model.modules() if isinstance(m, tuple(layer_classes))]
    chosen = layers_to_wrap(len(layers), mode, every_n_layers)
    if not chosen:
        return chosen
    ids = {id(layers[i]) for i in chosen}
    wrapper: Callable[[nn.Module], nn.Module] = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if mode == ActivationCheckpointing.ops:
        wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=_ops_context)
    wrap_modules(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in ids)
    return chosen


def compile_units(model: nn.Module, layer_classes: Sequence[type]) -> List[nn.Module]:
    """The modules whose ``forward`` ``train.compile`` compiles: each decoder layer, or its checkpoint wrapper.

    A checkpointed layer is compiled with its wrapper, so the checkpoint (and the
    ``ops`` policy) is inside the graph; see the module docstring for why. FSDP's
    hooks run in ``Module.__call__`` and stay outside either way.

    Args:
        model: the wrapped model (FSDP2 units may be the wrappers).
        layer_classes: the decoder layer classes.

    Returns:
        One module per decoder layer, in forward order.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    units: List[nn.Module] = []
    inside = set()
    for m in model.modules():  # a wrapper comes before the layer it holds
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, tuple(layer_classes)):
            units.append(m)
            inside.add(id(m._checkpoint_wrapped_module))
        elif isinstance(m, tuple(layer_classes)) and id(m) not in inside:
            units.append(m)
    return units


def compile_unit(unit: nn.Module, **options: Any) -> None:
    """``torch.compile`` one unit's ``forward`` in place (``options`` go to ``torch.compile``).

    Dynamo refuses a side effect inside a checkpointed region, because eager checkpointing
    would replay it in backward and the compiled graph would not. Since transformers 5.25
    every attention module has one: the ``kernels`` package's ``use_kernelized_func``
    sets a context variable around ``forward`` and resets it after. Refused, the
    checkpoint breaks the graph, and the ``ops`` policy silently runs as eager regions
    (what :func:`compile_units` exists to avoid). That set/reset pair leaves nothing
    behind, so skipping it in the recompute is exact; dynamo's
    ``skip_fwd_side_effects_in_bwd_under_checkpoint`` says so. Set per process, before
    the first trace; absent from a torch build that lacks it (nothing refused there).
    tests/train/test_ac_policy.py compiles with ``fullgraph=True``, so a break fails it.
    """
    config = torch._dynamo.config
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    unit.forward = torch.compile(unit.forward, **options)  # type: ignore[method-assign]


def graph_break_summary() -> str | None:
    """What ``torch.compile`` broke so far in this process, one line (None: no graph break).

    A break inside a compiled decoder layer splits it into eager regions: the ``ops``
    policy then no longer sees the layer's ops, and compile's gain shrinks. A library
    release can bring one without a word (transformers 5.25 did), so the trainer logs
    this after its first step instead of running slower in silence.
    """
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break") or {}
    if not breaks:
        return None
    reasons = sorted(breaks.items(), key=lambda kv: -kv[1])
    shown = "; ".join(f"{n} x {reason.splitlines()[0][:160]}" for reason, n in reasons[:3])
    more = f" (and {len(reasons) - 3} more reasons)" if len(reasons) > 3 else ""
    return (f"torch.compile broke the compiled layers' graphs {sum(breaks.values())} time(s): {shown}{more}. "
            "The layers run as eager regions between the breaks (slower; activation_checkpointing=ops no longer "
            "applies inside them). `python -m fsdp_workflow --version` shows whether the libraries are the tested "
            "ones; TORCH_LOGS=graph_breaks shows where")

