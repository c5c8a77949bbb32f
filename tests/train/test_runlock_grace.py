"""Rank 0 waits for the submitting command's lock (it holds it until sbatch returns), for nobody else's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.train import runlock

HOLD = textwrap.dedent("""
    import sys, time
    from fsdp_workflow.core.lock import acquire
    lock = acquire(sys.argv[1], sys.argv[2])
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def _hold(path: Path, what: str, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), what, str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_rank0_waits_for_the_planner_that_is_still_submitting(tmp_path: Path) -> None:
    run = RunDir.of(tmp_path / "run")
    proc = _hold(run.lock, "planning and launching the run (python -m fsdp_workflow)", 2.0)
    try:
        start = time.monotonic()
        lock = runlock.hold_run_lock(run)
        assert lock is not None and lock.held and time.monotonic() - start >= 1.0
        lock.release()
    finally:
        proc.kill()
        proc.wait()


def test_rank0_refuses_another_trainer_at_once(tmp_path: Path) -> None:
    run = RunDir.of(tmp_path / "run")
    proc = _hold(run.lock, "training (rank 0)", 60.0)
    try:
        start = time.monotonic()
        with pytest.raises(runlock.RunLocked, match=f"pid {proc.pid}"):
            runlock.hold_run_lock(run)
        assert time.monotonic() - start < 5.0
    finally:
        proc.kill()
        proc.wait()
