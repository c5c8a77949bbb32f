"""FSDP1 (FlatParameter) through Accelerate's plugin: deprecated upstream, kept for older stacks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

from fsdp_workflow.config.choices import ActivationCheckpointing, Device
from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.strategies.base import StrategySpec
from fsdp_workflow.config.strategies.fsdp_env import flag, fsdp_env

if TYPE_CHECKING:
    from fsdp_workflow.config.schema import WorkflowConfig

ORDER = 1  # StrategyName: fsdp2, fsdp1, ddp, deepspeed_zero1-3


def env(cfg: WorkflowConfig) -> Dict[str, str]:
    """FSDP1's plugin variables: its sharding strategy, prefetch and parameter flags."""
    s = cfg.strategy
    return fsdp_env(cfg, 1, {
        "FSDP_SHARDING_STRATEGY": s.sharding_strategy.value,
        "FSDP_BACKWARD_PREFETCH": s.backward_prefetch.value,
        "FSDP_FORWARD_PREFETCH": flag(s.forward_prefetch),
        "FSDP_USE_ORIG_PARAMS": flag(s.use_orig_params),
        "FSDP_SYNC_MODULE_STATES": flag(s.sync_module_states),
    })


def memory(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
    """fp32 params, grads and the optimizer state sharded over the world."""
    return 4 * p / world, 4 * p / world, opt / world


def check_deprecated(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """FSDP1 is deprecated: say so, with the way out."""
    r.warn(
        "strategy.name", cfg.strategy.name,
        "FSDP1 (FlatParameter) is deprecated in PyTorch and Accelerate; FSDP2 (fully_shard, "
        "DTensor) is maintained, composes with TP and saves DCP checkpoints directly",
        "strategy=fsdp2",
    )


def check_fsdp1(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Hybrid sharding on one node, offload with an 8-bit optimizer, RAM-efficient loading, CPU, selective AC."""
    s, o = cfg.strategy, cfg.optimizer
    if s.sharding_strategy.value.startswith("HYBRID") and cfg.cluster.nodes == 1:
        r.warn(
            "strategy.sharding_strategy", s.sharding_strategy,
            "hybrid sharding shards within a node and replicates across nodes; on one node it is plain sharding",
            "strategy.sharding_strategy=FULL_SHARD",
        )
    if s.offload_params and o.name.is_8bit:
        r.error(
            "strategy.offload_params", True,
            f"FSDP1 parameter offload runs the optimizer step on CPU tensors; the 8-bit optimizer "
            f"{o.name.value} needs its state on the GPU",
            "optimizer=adamw (or strategy.offload_params=false)",
        )
    if s.cpu_ram_efficient_loading and not s.sync_module_states:
        r.error(
            "strategy.sync_module_states", False,
            "with cpu_ram_efficient_loading only rank 0 loads weights; FSDP1 must broadcast them to the others",
            "strategy.sync_module_states=true (or strategy.cpu_ram_efficient_loading=false)",
        )
    if cfg.cluster.device == Device.cpu:
        # Whatever sync_module_states says: Accelerate enables FSDP1 only on accelerators, and the
        # trainer stops every rank at start ("needs CUDA"). Its sync flags are not a way out.
        r.error(
            "strategy.name", s.name,
            "FSDP1 needs CUDA: Accelerate only enables FSDP1 on accelerators (its sync_module_states raises "
            "'no available devices' on a CPU host), and this trainer shards on CPU with FSDP2 only",
            "strategy=fsdp2 for CPU runs (same checkpoint layout), strategy=ddp, or cluster.device=cuda",
        )


def check_activation_checkpointing(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Accelerate's FSDP1 plugin checkpoints every layer or none: the selective modes are FSDP2's."""
    mode = cfg.strategy.activation_checkpointing
    if mode not in (ActivationCheckpointing.none, ActivationCheckpointing.full):
        r.error(
            "strategy.activation_checkpointing", mode,
            "the selective modes are built on the FSDP2 path only (FSDP1 goes through Accelerate's plugin, "
            "which checkpoints every layer or none)",
            "strategy=fsdp2, or strategy.activation_checkpointing=full",
        )


SPECS = (
    StrategySpec(
        name="fsdp1",
        memory=memory,
        held="FSDP1 shards the model over all of them",
        accelerate_fsdp=True,
        env=env,
        gathers_weights=True,
        activation_checkpointing=frozenset({ActivationCheckpointing.full}),
        ema="not implemented for fsdp1: its FlatParameter shards do not have the checkpoint's layout",
        rules=(check_deprecated, check_fsdp1, check_activation_checkpointing),
    ),
)
