"""FSDP2 (``fully_shard``, DTensor parameters): the recommended strategy, and the only one with a mesh."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

from fsdp_workflow.config.choices import ActivationCheckpointing, MixedPrecision
from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.strategies.base import StrategySpec, changed
from fsdp_workflow.config.strategies.fsdp_env import flag, fsdp_env

if TYPE_CHECKING:
    from fsdp_workflow.config.schema import WorkflowConfig

ORDER = 0  # StrategyName: fsdp2, fsdp1, ddp, deepspeed_zero1-3

# The FSDP1-only knobs: FSDP2 ignores them (forward_prefetch it refuses).
FSDP1_ONLY = ("sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states")


def env(cfg: WorkflowConfig) -> Dict[str, str]:
    """FSDP2's plugin variables, then the device mesh when it has more than one dimension."""
    # FSDP2 expresses the sharding strategy as a bool; the FSDP1-only knobs are ignored or rejected by its plugin.
    return {**fsdp_env(cfg, 2, {"FSDP_RESHARD_AFTER_FORWARD": flag(cfg.strategy.reshard_after_forward)}),
            **_mesh_env(cfg)}


def _mesh_env(cfg: WorkflowConfig) -> Dict[str, str]:
    """The device mesh in ``ParallelismConfig``'s variable names, when it has more than one dimension.

    For Accelerate only: the trainer builds its mesh from the typed config
    (``fsdp_workflow.train.mesh``, the same :func:`mesh_shape`). ``ACCELERATE_USE_PARALLELISM_CONFIG``
    is deliberately not set, so Accelerate does not build a ``ParallelismConfig`` of its
    own: it refuses one on CPU, and its FSDP2 + TP preparation (accelerate 1.15)
    imports ``ReplicateParallel``, which transformers 5 no longer has. The trainer
    applies TP and FSDP2 on this mesh itself, on CPU and GPU alike (docs/parallelism.md).
    Context parallelism is refused by validation, so no ``CP_SIZE`` is written.
    """
    from fsdp_workflow.config.schema import mesh_shape  # the schema lists this module: not at import time

    s = cfg.strategy
    if s.dp_replicate_size == 1 and s.tensor_parallel_size == 1:
        return {}
    shape = mesh_shape(cfg)
    return {
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(shape["dp_replicate"]),
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(shape["dp_shard"]),
        "PARALLELISM_CONFIG_TP_SIZE": str(shape["tp"]),
    }


def memory(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
    """fp32 master params and grads sharded over ``tp x dp_shard x cp``; the optimizer follows the shards."""
    shards = mesh["tp"] * mesh["dp_shard"] * mesh["cp"]
    return 4 * p / shards, 4 * p / shards, opt / shards


def check_fsdp2(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """FSDP2 rejects what only FSDP1 had, and bitsandbytes' optimizer."""
    s, o = cfg.strategy, cfg.optimizer
    if o.name.is_bitsandbytes:
        r.error(
            "optimizer.name", o.name,
            "bitsandbytes 8-bit AdamW cannot step FSDP2's DTensor parameters",
            "optimizer=adamw_torch_8bit (torchao's 8-bit AdamW works with DTensors)",
        )
    for name in changed(s, FSDP1_ONLY):
        if name == "forward_prefetch":
            continue  # an error below: Accelerate raises on it
        r.warn(
            f"strategy.{name}", getattr(s, name),
            "an FSDP1-only setting: FSDP2 ignores it",
            f"drop the override of strategy.{name}, or strategy=fsdp1",
        )
    if s.forward_prefetch:
        r.error(
            "strategy.forward_prefetch", True,
            "Accelerate raises: forward_prefetch is not implemented for FSDP2",
            "strategy.forward_prefetch=false",
        )
    if cfg.train.mixed_precision == MixedPrecision.fp16:
        r.warn(
            "train.mixed_precision", "fp16",
            "fp16 under FSDP2 needs a sharded grad scaler and overflows more easily; bf16 is the tested path",
            "train.mixed_precision=bf16",
        )


SPECS = (
    StrategySpec(
        name="fsdp2",
        memory=memory,
        accelerate_fsdp=True,
        env=env,
        builds_mesh=True,
        gathers_weights=True,
        activation_checkpointing=frozenset(ActivationCheckpointing),
        ema=None,
        float8=True,
        compile_measured=True,
        rules=(check_fsdp2,),
    ),
)
