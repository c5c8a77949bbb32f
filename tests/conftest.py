"""Shared test helpers. Stage-specific fixtures live in each tests/<stage>/conftest.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests never reach a model hub: everything is built from small configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Paths that break naive shell quoting (spaces, quotes, ;, $, backticks, a newline).
WEIRD_NAMES = [
    "plain",
    "with space",
    "quote'single",
    'quote"double',
    "semi;colon && rm -rf nothing",
    "dollar$HOME`id`",
    "new\nline",
]


@pytest.fixture(params=WEIRD_NAMES, ids=lambda n: n.encode("unicode_escape").decode()[:20])
def weird_dir(request, tmp_path: Path) -> Path:
    """A fresh directory whose name is hostile to shell scripts."""
    d = tmp_path / request.param
    d.mkdir()
    return d


@pytest.fixture
def python() -> str:
    return sys.executable
