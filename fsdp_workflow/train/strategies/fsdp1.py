"""FSDP1 through Accelerate's plugin (``accelerator.prepare``), on accelerators only."""

from __future__ import annotations

from fsdp_workflow.config.schema import StrategyName
from fsdp_workflow.train.mesh import StrategyError
from fsdp_workflow.train.strategies.base import TrainStrategy


def check_available(strategy: StrategyName, device_type: str) -> None:
    """Accelerate only builds FSDP1 on accelerators, and we do not hand-roll FlatParameter FSDP on CPU."""
    if device_type == "cpu":
        raise StrategyError(
            "strategy=fsdp1 needs CUDA: Accelerate only enables FSDP on accelerators "
            "and this trainer shards on CPU with FSDP2 only. Use strategy=fsdp2 (recommended; same "
            "checkpoint layout) or strategy=ddp on CPU."
        )


SPECS = (TrainStrategy(StrategyName.fsdp1, check_available=check_available),)
