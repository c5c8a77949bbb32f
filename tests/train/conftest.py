"""Shared 2-rank gloo training runs for tests/train (module-scoped: one run serves many assertions)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsdp_workflow.core.rundir import RunDir

from tests.train.runner import launched, make_run_dir

# 20 steps, a checkpoint every 10, all kept: the reference for resume exactness.
# Gradient accumulation and async DCP saves ride along (resuming from an async
# checkpoint must reproduce the run exactly too).
STRAIGHT = [
    "train.max_steps=20", "train.grad_accum_steps=2", "checkpoint.every_steps=10", "checkpoint.keep_last=0",
    "checkpoint.async_save=true", "optimizer.lr=3e-3",
]


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default strategy (FSDP2) on 2 CPU ranks, 20 steps straight."""
    return launched(make_run_dir(tmp_path_factory.mktemp("straight") / "run", STRAIGHT))


def copy_run(src: Path, dest: Path, checkpoints: tuple[int, ...]) -> Path:
    """A fresh run dir with ``src``'s config, launch.env, data pointer and hf_assets, and only the given checkpoints.

    The data pointer names ``src``'s token cache by its absolute path, so the copy
    trains on the very same cache (as a resubmitted run does).
    """
    dest.mkdir(parents=True)
    a, b = RunDir.of(src), RunDir.of(dest)
    for name in ("config", "launch_env", "data_pointer"):
        shutil.copy2(getattr(a, name), getattr(b, name))
    shutil.copytree(src / "hf_assets", dest / "hf_assets")
    (dest / "checkpoints").mkdir()
    for step in checkpoints:
        shutil.copytree(src / "checkpoints" / f"step-{step}", dest / "checkpoints" / f"step-{step}")
    return dest
