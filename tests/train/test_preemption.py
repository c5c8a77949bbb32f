"""Preemption: SIGUSR2 through torchrun -> checkpoint at the current step, exit 75; kill -9 during a save."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from fsdp_workflow.exit_codes import EXIT_REQUEUE
from fsdp_workflow.train.checkpoint import SAVE_DELAY_ENV
from tests.train.conftest import copy_run
from tests.train.runner import FORWARD_SIGNALS, launch, log_text, losses, make_run_dir, rank_pids, start, wait_for_step

pytestmark = pytest.mark.slow


def test_sigusr2_to_torchrun_checkpoints_and_exits_75(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path / "run", [
        "train.max_steps=500", "checkpoint.every_steps=0", "optimizer.lr=3e-3",
        "strategy.activation_checkpointing=true",
    ])
    proc = start(run, torchrun_args=FORWARD_SIGNALS)
    try:
        wait_for_step(run, 3, proc)
        os.kill(proc.pid, signal.SIGUSR2)  # what Slurm's --signal=B:USR2 does to the batch step's launcher
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    # torchrun reports any non-zero worker exit as 1; the trainer's own code is in train_exit.json.
    assert proc.returncode == 1, log_text(run)
    info = json.loads((run / "train_exit.json").read_text())
    assert info["exit_code"] == EXIT_REQUEUE and "SIGUSR2" in info["reason"], info
    last = max(losses(run))
    assert 3 <= last < 500 and info["step"] == last
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step-{last}"], ckpts
    md = FileSystemReader(str(run / "checkpoints" / f"step-{last}")).read_metadata()
    assert "model.model.layers.0.mlp.up_proj.weight" in md.state_dict_metadata  # no checkpoint-wrapper names
    assert not any("_checkpoint_wrapped_module" in k for k in md.state_dict_metadata)


def test_kill_9_during_save_keeps_previous_checkpoint(straight_run: Path, tmp_path: Path) -> None:
    """Resume from step-10, hang the step-20 save before .metadata, kill -9 everything, resume again."""
    run = copy_run(straight_run, tmp_path / "killed", checkpoints=(10,))
    ckpts = run / "checkpoints"
    before = {p.name: p.read_bytes() for p in (ckpts / "step-10").iterdir()}
    proc = start(run, extra_env={SAVE_DELAY_ENV: "120"})
    try:
        wait_for_step(run, 20, proc)
        deadline = time.monotonic() + 60
        while not (ckpts / "step-20.tmp" / "__1_0.distcp").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        for pid in [*rank_pids(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step-10", "step-20.tmp"], names
    assert not (ckpts / "step-20.tmp" / ".metadata").exists()
    assert {p.name: p.read_bytes() for p in (ckpts / "step-10").iterdir()} == before

    proc2 = launch(run)
    assert proc2.returncode == 0, log_text(run)
    assert f"resumed from {ckpts / 'step-10'}" in log_text(run)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-10", "step-20"]
    ref, got = losses(straight_run), losses(run)  # last line of a step wins
    assert [got[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]
