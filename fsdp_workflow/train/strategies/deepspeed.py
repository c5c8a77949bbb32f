"""DeepSpeed ZeRO through ``accelerator.prepare``, checkpointed in DeepSpeed's own format."""

from __future__ import annotations

import importlib.util

from fsdp_workflow.config.schema import CheckpointConfig, StrategyName
from fsdp_workflow.config.strategies import STRATEGIES
from fsdp_workflow.train.checkpoint import CheckpointDir, Checkpointer
from fsdp_workflow.train.checkpointers import DeepSpeedCheckpointer
from fsdp_workflow.train.mesh import StrategyError
from fsdp_workflow.train.parallel import ModelParts, Prepared, accelerate_prepare
from fsdp_workflow.train.strategies.base import TrainStrategy


def check_available(strategy: StrategyName, device_type: str) -> None:
    """CUDA, and the ``deepspeed`` package."""
    # The device first: on CPU the answer must not depend on what happens to be installed.
    if device_type == "cpu":
        raise StrategyError(
            "strategy=deepspeed_zero* needs CUDA GPUs: DeepSpeed's CPU accelerator needs Intel's oneCCL "
            "bindings, which this project does not support. Use strategy=fsdp2 (sharded like ZeRO-3) or "
            "strategy=ddp on CPU."
        )
    if importlib.util.find_spec("deepspeed") is None:
        raise StrategyError(
            f"strategy={strategy.value} needs the `deepspeed` package, which is not installed in this "
            "environment. Install it (`pip install 'fsdp_workflow[deepspeed]'`, on a machine with CUDA) or "
            "choose strategy=fsdp2 or strategy=ddp."
        )


def prepare(parts: ModelParts) -> Prepared:
    """Accelerate's prepare, with DeepSpeed's micro-batch size set from ``train.micro_batch_size``."""

    def micro_batch() -> None:
        ds = parts.accelerator.state.deepspeed_plugin
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = parts.cfg.train.micro_batch_size

    return accelerate_prepare(parts, before_optimizer=micro_batch)


def checkpointer(directory: CheckpointDir, cfg: CheckpointConfig, prepared: Prepared,
                 timeout_s: float) -> Checkpointer:
    """DeepSpeed's engine writes its own format (``latest``, ``global_stepN/``)."""
    return DeepSpeedCheckpointer(directory, prepared.model)


# One per ZeRO stage the planning half lists (deepspeed_zero1, 2 and 3).
SPECS = tuple(
    TrainStrategy(name, prepare=prepare, check_available=check_available, checkpointer=checkpointer)
    for name, spec in STRATEGIES.items() if spec.accelerate_deepspeed
)
