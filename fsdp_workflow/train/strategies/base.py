"""What the trainer knows of one strategy: :class:`TrainStrategy`, the torch half of its spec.

The planning half (Accelerate variables, mesh words, memory terms, rules) is
:class:`fsdp_workflow.config.strategies.StrategySpec`; this one wraps the model and
picks the checkpointer, keyed by the same
:class:`~fsdp_workflow.config.schema.StrategyName`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fsdp_workflow.config.schema import CheckpointConfig, StrategyName
from fsdp_workflow.train.checkpoint import CheckpointDir, Checkpointer
from fsdp_workflow.train.checkpointers import dcp_checkpointer
from fsdp_workflow.train.parallel import ModelParts, Prepared, accelerate_prepare


def runs_anywhere(strategy: StrategyName, device_type: str) -> None:
    """A strategy with nothing to check before the process group starts."""


@dataclass(frozen=True)
class TrainStrategy:
    """One distribution strategy, as the trainer runs it."""

    name: StrategyName
    # wraps the model and pairs it with its optimizer (default: Accelerate's prepare)
    prepare: Callable[[ModelParts], Prepared] = accelerate_prepare
    # raises StrategyError, with the fix, where the strategy cannot run: (strategy, "cpu" or "cuda")
    check_available: Callable[[StrategyName, str], None] = runs_anywhere
    # the checkpointer for the prepared model: (directory, checkpoint group, prepared, collective timeout in s)
    checkpointer: Callable[[CheckpointDir, CheckpointConfig, Prepared, float], Checkpointer] = dcp_checkpointer
