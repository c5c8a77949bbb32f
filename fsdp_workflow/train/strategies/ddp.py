"""DDP through ``accelerator.prepare``: the defaults of :class:`.base.TrainStrategy`."""

from __future__ import annotations

from fsdp_workflow.config.schema import StrategyName
from fsdp_workflow.train.strategies.base import TrainStrategy

SPECS = (TrainStrategy(StrategyName.ddp),)
