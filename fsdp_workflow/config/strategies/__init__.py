"""The registry of distribution strategies' planning halves: ``STRATEGIES[name] -> StrategySpec``.

Each module of this package is one strategy family and lists its specs in ``SPECS``;
the registry gathers them, so adding a strategy adds a module here (and its trainer
half in ``fsdp_workflow/train/strategies/``), not a branch in every stage.
``docs/contributing.md`` ("Adding a strategy") lists the files.

No torch import here: planning must stay fast.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict

from fsdp_workflow.config.schema import StrategyName, WorkflowConfig
from fsdp_workflow.config.strategies.base import StrategySpec

__all__ = ["STRATEGIES", "StrategySpec", "spec", "spec_of", "is_fsdp", "is_deepspeed"]

# Modules of this package that hold no strategy.
_HELPERS = frozenset({"base", "fsdp_env"})


def _gather() -> Dict[StrategyName, StrategySpec]:
    found: Dict[StrategyName, StrategySpec] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _HELPERS:
            continue
        for s in importlib.import_module(f"{__name__}.{info.name}").SPECS:
            assert s.name not in found, f"strategy {s.name.value} has two specs"
            found[s.name] = s
    return {name: found[name] for name in StrategyName if name in found}  # StrategyName's order


STRATEGIES: Dict[StrategyName, StrategySpec] = _gather()


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
