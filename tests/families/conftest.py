"""The family replicas, built once per test session and shared by the planning and training tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import pytest

from .replicas import BY_KEY, Replica, build


@pytest.fixture(scope="session")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Replica], Path]:
    """``replica(row)``: the directory of ``row``'s replica, written on first use (about 0.6 s each)."""
    root = tmp_path_factory.mktemp("replicas")
    built: Dict[str, Path] = {}

    def get(row: Replica) -> Path:
        assert BY_KEY[row.key] is row, row
        if row.key not in built:
            built[row.key] = build(row, root / row.key)
        return built[row.key]

    return get
