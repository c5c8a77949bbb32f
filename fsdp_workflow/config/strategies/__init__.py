"""The distribution strategies' planning halves: one module per family, found here without a list.

Each module of this package (but the helpers below) is one strategy family: it lists
its :class:`~.base.StrategySpec` records in ``SPECS`` and may say where its names come
in :class:`~fsdp_workflow.config.schema.StrategyName` with ``ORDER`` (the order of the
allowed values in messages; a module without one comes last, by module name). The
schema builds ``StrategyName`` from :func:`strategy_names`, and :mod:`.registry`
keys :data:`STRATEGIES` by it, so adding a strategy adds a module here (and its
trainer half in ``fsdp_workflow/train/strategies/``, and its YAML), nothing else.
``docs/contributing.md`` ("Adding a strategy") lists the files.

This module imports nothing of ours at import time: the schema imports it, and the
spec modules are typed against the schema. The registry's names (``STRATEGIES``,
``spec``, ``spec_of``, ``is_fsdp``, ``is_deepspeed``, ``StrategySpec``) load on first
use. No torch import here: planning must stay fast.
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
from typing import Any, Tuple

__all__ = ["STRATEGIES", "StrategySpec", "spec", "spec_of", "is_fsdp", "is_deepspeed", "gathered",
           "strategy_names"]

# Modules of this package that hold no strategy (the registry imports the schema: never gathered).
_HELPERS = frozenset({"base", "fsdp_env", "registry"})
_LAZY = {"STRATEGIES": "registry", "spec": "registry", "spec_of": "registry", "is_fsdp": "registry",
         "is_deepspeed": "registry", "StrategySpec": "base"}


@functools.lru_cache(maxsize=None)
def gathered() -> Tuple[Any, ...]:
    """Every module's ``SPECS``, modules by ``ORDER`` then name, each module's specs in its own order.

    Returns:
        The :class:`~.base.StrategySpec` records (their ``name`` a plain string).
    """
    modules = [importlib.import_module(f"{__name__}.{info.name}")
               for info in pkgutil.iter_modules(__path__) if info.name not in _HELPERS]
    modules.sort(key=lambda m: (getattr(m, "ORDER", math.inf), m.__name__))
    specs = tuple(s for m in modules for s in m.SPECS)
    names = [s.name for s in specs]
    assert len(set(names)) == len(names), f"a strategy has two specs: {names}"
    return specs


def strategy_names() -> Tuple[str, ...]:
    """The strategies' names, in the order ``StrategyName`` lists them (fsdp2 first)."""
    return tuple(s.name for s in gathered())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
