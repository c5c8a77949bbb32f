"""The registry of distribution strategies' planning halves: ``STRATEGIES[name] -> StrategySpec``.

Keyed by :class:`~fsdp_workflow.config.schema.StrategyName`, which the schema builds
from the same modules (:func:`fsdp_workflow.config.strategies.gathered`), so the two
cannot disagree. Import these names from ``fsdp_workflow.config.strategies``.

No torch import here: planning must stay fast.
"""

from __future__ import annotations

from typing import Dict

from fsdp_workflow.config.schema import StrategyName, WorkflowConfig
from fsdp_workflow.config.strategies import gathered
from fsdp_workflow.config.strategies.base import StrategySpec

STRATEGIES: Dict[StrategyName, StrategySpec] = {StrategyName(s.name): s for s in gathered()}  # StrategyName's order


def spec(name: StrategyName) -> StrategySpec:
    """The planning half of strategy ``name``."""
    return STRATEGIES[name]


def spec_of(cfg: WorkflowConfig) -> StrategySpec:
    """The planning half of ``cfg.strategy.name``."""
    return STRATEGIES[cfg.strategy.name]


def is_fsdp(name: StrategyName) -> bool:
    """Whether Accelerate's FSDP plugin runs the strategy (so the FSDP knobs apply)."""
    return STRATEGIES[name].accelerate_fsdp


def is_deepspeed(name: StrategyName) -> bool:
    """Whether Accelerate's DeepSpeed plugin runs the strategy (so the DeepSpeed knobs apply)."""
    return STRATEGIES[name].accelerate_deepspeed
