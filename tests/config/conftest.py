"""Fixtures for the config tests: cached composition and a clean Accelerate environment."""

from __future__ import annotations

import copy
import functools
import os
from typing import Callable, Sequence, Tuple

import pytest

from fsdp_workflow.config.load import compose
from fsdp_workflow.config.schema import WorkflowConfig

ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


@functools.lru_cache(maxsize=None)
def _compose_cached(overrides: Tuple[str, ...]) -> WorkflowConfig:
    # The config tests vary the smoke experiment unless they name another one.
    names_experiment = any(o.lstrip("+~").startswith("experiment") for o in overrides)
    return compose(list(overrides) if names_experiment else ["+experiment=smoke", *overrides])


@pytest.fixture
def composed() -> Callable[[Sequence[str]], WorkflowConfig]:
    """Compose ``conf/`` with overrides (cached; each call returns a private copy)."""

    def _compose(overrides: Sequence[str] = ()) -> WorkflowConfig:
        return copy.deepcopy(_compose_cached(tuple(overrides)))

    return _compose


@pytest.fixture
def clean_accelerate_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Remove every variable Accelerate's plugins read, so only the test's values count."""
    for key in list(os.environ):
        if key.startswith(ENV_PREFIXES):
            monkeypatch.delenv(key)
    return monkeypatch
