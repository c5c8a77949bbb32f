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
def small_fs(request, tmp_path: Path):
    """A real size-limited tmpfs under ``tmp_path`` (as root; CI runs as root), unmounted afterwards.

    The size comes from ``@pytest.mark.fs_size("3200k")`` on the test (default 64k): a
    filesystem that fills up for real, with the kernel's own ENOSPC.
    """
    import subprocess

    marker = request.node.get_closest_marker("fs_size")
    size = marker.args[0] if marker else "64k"
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def python() -> str:
    return sys.executable
