"""A local ``-m`` sweep runs every point whatever another point did (issue 36, item 5).

    python -m pytest tests/launch/test_sweep.py

The real command: ``python -m fsdp_workflow -m +experiment=smoke optimizer.lr=1e20,1e-3
run_dir=SWEEP`` on this machine. The first point diverges (NaN at step 2, exit 65); the
second still trains to its last step; the sweep exits 65, the worst point's code; and
``python -m fsdp_workflow.status SWEEP`` lists both outcomes. The Slurm route (a point
refused by sbatch, the next one still submitted) is in tests/slurm/test_sweep_slurm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.core.exit_codes import (EXIT_DISK_FULL, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_NONFINITE,
                                           EXIT_REQUEUE, EXIT_USAGE, worst)
from tests.train.runner import _process_env, metrics_steps

# One rank, 3 steps, no consolidation: the cheapest run that trains, checkpoints and can diverge.
# lr 1e20 turns the loss into NaN at step 2 (the NaN guard stops the point there, exit 65).
CHEAP = ["+experiment=smoke", "cluster=local", "cluster.processes_per_node=1", "train.seq_len=64",
         "train.max_steps=3", "optimizer.warmup_steps=0", "checkpoint.every_steps=3", "consolidate.enabled=false"]


@pytest.mark.parametrize("codes,expected", [
    ([0, 0], 0),
    ([EXIT_NONFINITE, 0], EXIT_NONFINITE),
    ([0, EXIT_USAGE, EXIT_NONFINITE], EXIT_NONFINITE),  # the highest code
    ([EXIT_REQUEUE, EXIT_USAGE], EXIT_USAGE),  # a preemption (resumes) ranks below any failure
    ([EXIT_REQUEUE, 0], EXIT_REQUEUE),
    ([EXIT_FAILURE, EXIT_DISK_FULL, EXIT_INTERRUPTED], EXIT_INTERRUPTED),
])
def test_the_sweep_exits_with_the_worst_points_code(codes: list, expected: int) -> None:
    assert worst(codes) == expected


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_diverging_point_does_not_stop_the_next_and_the_sweep_exits_with_its_code(tmp_path: Path) -> None:
    sweep = tmp_path / "lr sweep"
    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", "-m", *CHEAP, "optimizer.lr=1e20,1e-3",
                          f"run_dir={sweep}"], env=_process_env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=280)
    err = res.stderr
    assert res.returncode == EXIT_NONFINITE, err[-4000:]
    # Point 0 diverged and stopped; point 1 ran after it, all its steps, and saved its last checkpoint.
    assert json.loads((sweep / "0" / "train_exit.json").read_text())["exit_code"] == EXIT_NONFINITE
    assert metrics_steps(sweep / "1") == [1, 2, 3], err[-4000:]
    assert (sweep / "1" / "checkpoints" / "step-3" / ".metadata").is_file()
    index = json.loads((sweep / "sweep.json").read_text())
    assert [(p["num"], p["run_dir"], p["exit_code"]) for p in index["points"]] == [
        (0, str(sweep / "0"), EXIT_NONFINITE), (1, str(sweep / "1"), 0)]
    # The command's last line: how each point ended, the exit code, and where to look.
    last = err.strip().splitlines()[-1]
    assert "sweep: 2 of 2 points ran: 1 finished, 1 exited 65" in last and "Exit 65 (the worst point's)" in last, last
    assert "python -m fsdp_workflow.status" in last and "Traceback" not in err, err[-4000:]

    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(sweep), "--json"],
                        capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    rows = json.loads(st.stdout)
    assert [(r["num"], r["state"], r["step"], r["max_steps"]) for r in rows] == [
        (0, "failed (65)", 2, 3), (1, "done", 3, 3)], rows
