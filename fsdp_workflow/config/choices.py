"""The choices the strategy specs read, below the schema so that the schema can list the specs.

``fsdp_workflow.config.schema`` derives :class:`~fsdp_workflow.config.schema.StrategyName`
from the specs in ``fsdp_workflow/config/strategies/``, and those specs compare these
enums; kept here, neither imports the other at import time. The schema re-exports every
one, so ``from fsdp_workflow.config.schema import MixedPrecision`` still works.

No import of ours here, and no torch: planning must stay fast.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ActivationCheckpointing", "AutoWrapPolicy", "Device", "MixedPrecision", "OffloadDevice"]


class AutoWrapPolicy(str, Enum):
    """Which submodules become FSDP units (Accelerate's ``FSDP_AUTO_WRAP_POLICY``)."""

    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


class ActivationCheckpointing(str, Enum):
    """Which activations of the decoder layers are recomputed in backward instead of kept (FSDP only).

    Every mode gives the same losses and gradients as ``none``; they trade memory for
    recomputation differently (docs/training.md, "Activation checkpointing").
    """

    none = "none"  # keep every activation: fastest, most memory
    full = "full"  # recompute every decoder layer (keep only its input)
    every_n_layers = "every_n_layers"  # recompute every Nth layer (strategy.activation_checkpointing_every_n_layers)
    ops = "ops"  # every layer, but keep attention and every second matmul; recompute the rest (norms, rotary...)


class OffloadDevice(str, Enum):
    """DeepSpeed offload target."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class MixedPrecision(str, Enum):
    """Accelerate's ``ACCELERATE_MIXED_PRECISION``."""

    no = "no"
    bf16 = "bf16"
    fp16 = "fp16"


class Device(str, Enum):
    """What each rank computes on (``cluster.device``)."""

    cuda = "cuda"
    cpu = "cpu"
