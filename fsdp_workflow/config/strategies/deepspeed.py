"""DeepSpeed ZeRO stages 1, 2 and 3 through Accelerate's plugin: one spec per stage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

from fsdp_workflow.config.choices import OffloadDevice
from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.strategies.base import MemoryTerms, StrategySpec
from fsdp_workflow.config.strategies.fsdp_env import flag

if TYPE_CHECKING:
    from fsdp_workflow.config.schema import WorkflowConfig

ORDER = 3  # StrategyName: fsdp2, fsdp1, ddp, deepspeed_zero1-3


def stage_of(cfg: WorkflowConfig) -> int:
    """The ZeRO stage that runs: ``strategy.zero_stage`` if given (validation makes it agree), else the name's."""
    s = cfg.strategy
    return s.zero_stage if s.zero_stage is not None else _STAGES[s.name.value]


def env(cfg: WorkflowConfig) -> Dict[str, str]:
    """DeepSpeed's plugin variables: the stage, offload targets, ZeRO-3 init and clipping."""
    s = cfg.strategy
    stage = stage_of(cfg)
    env: Dict[str, str] = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": s.offload_optimizer_device.value,
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": s.offload_param_device.value,
    }
    if s.offload_optimizer_device == OffloadDevice.nvme:
        env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] = str(s.offload_nvme_path)
    if s.offload_param_device == OffloadDevice.nvme:
        env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] = str(s.offload_nvme_path)
    # Accelerate warns and resets the flag below stage 3; write what takes effect.
    env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = flag(s.zero3_init_flag and stage == 3)
    # "0.0" is falsy after float(): DeepSpeed's config then carries no clipping.
    clip = cfg.optimizer.max_grad_norm
    env["ACCELERATE_GRADIENT_CLIPPING"] = repr(float(clip)) if clip else "0.0"
    return env


def _zero1(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
    return low * p + 4 * p / world, low * p, opt / world  # optimizer state (and fp32 master) partitioned


def _zero2(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
    return low * p + 4 * p / world, low * p / world, opt / world  # and the gradients


def _zero3(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
    return (low + 4) * p / world, low * p / world, opt / world  # and the parameters


def check_deepspeed(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Stage named twice must agree; offload targets must exist at that stage."""
    s, o = cfg.strategy, cfg.optimizer
    named = _STAGES[s.name.value]
    stage = stage_of(cfg)
    if s.zero_stage is not None and s.zero_stage != named:
        r.error(
            "strategy.zero_stage", s.zero_stage,
            f"strategy {s.name.value} means ZeRO stage {named}",
            f"strategy=deepspeed_zero{s.zero_stage} (or strategy.zero_stage={named})"
            if s.zero_stage in (1, 2, 3) else f"strategy.zero_stage={named}",
        )
    if s.offload_param_device != OffloadDevice.none and stage != 3:
        r.error(
            "strategy.offload_param_device", s.offload_param_device,
            f"DeepSpeed offloads parameters only under ZeRO-3 (stage here: {stage})",
            "strategy=deepspeed_zero3 (or strategy.offload_param_device=none)",
        )
    nvme = OffloadDevice.nvme in (s.offload_param_device, s.offload_optimizer_device)
    if nvme and not s.offload_nvme_path:
        r.error(
            "strategy.offload_nvme_path", s.offload_nvme_path,
            "NVMe offload needs a directory on a local NVMe drive",
            "strategy.offload_nvme_path=/local_nvme/ds_offload",
        )
    if o.name.is_8bit:
        r.warn(
            "optimizer.name", o.name,
            "DeepSpeed partitions optimizer state itself; a client 8-bit optimizer is untested with ZeRO",
            "optimizer=adamw",
        )


def _spec(name: str, stage: int, memory: MemoryTerms) -> StrategySpec:
    return StrategySpec(
        name=name,
        memory=memory,
        held=f"DeepSpeed ZeRO stage {stage} over all of them",
        accelerate_deepspeed=True,
        env=env,
        ema="not implemented for deepspeed: ZeRO partitions and casts the parameters inside its engine, "
            "so there is no shard to average",
        zero_stage=stage,
        rules=(check_deepspeed,),
    )


SPECS = (
    _spec("deepspeed_zero1", 1, _zero1),
    _spec("deepspeed_zero2", 2, _zero2),
    _spec("deepspeed_zero3", 3, _zero3),
)
_STAGES = {spec.name: spec.zero_stage for spec in SPECS}
