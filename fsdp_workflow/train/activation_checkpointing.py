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
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps the
  outputs of the expensive ops, the matmuls and attention (and a reduce-scatter,
  should one run inside a layer), and recomputes only the cheap ones: norms,
  activation functions, rotary embeddings, elementwise arithmetic. This is the
  idea of torchtitan's op-level selective AC; torchtitan additionally recomputes
  every other matmul to save more memory, while this policy saves all of them, so
  backward never runs a forward matmul again.

Recomputation runs the same kernels on the same inputs, so every mode gives the
losses and gradients of ``none`` (tests/train/test_activation_checkpointing.py
checks that on 2 gloo ranks with FSDP2, and that ``ops`` runs no forward matmul
in backward). The mode is read from the typed config, never from the environment.
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


# Outputs the ``ops`` mode keeps: the FLOP-heavy ops of a decoder layer. Linear layers
# reach aten as mm (3-D inputs are folded to 2-D) or addmm (with a bias); attention as
# one of the fused SDPA kernels, or as bmm when SDPA falls back to its math path.
SAVED_OPS = _ops([
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_mm.default",  # train.float8's matmuls
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
])


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``ops`` policy: keep what :data:`SAVED_OPS` computes, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _ops_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_expensive)


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
