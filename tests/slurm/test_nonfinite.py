"""A diverging run on the real local Slurm (issue 24, item 1): the consolidation job never runs.

    python -m pytest tests/slurm/test_nonfinite.py

``optimizer.lr=1e6`` on the smoke model: the gradient norm or the loss is NaN
within a few steps. The trainer stops at that step with exit 65 (train_exit.json),
saves nothing from it, writes no ``.requeue``; train.sbatch therefore neither
requeues nor exits 0, and the ``afterok`` consolidation job is cancelled by Slurm
(``DependencyNeverSatisfied``), so no model is ever written. This is also the suite's
proof that a failed training job's consolidation never starts (the trainer's refusal
of a run without prepared data, another way to fail, is tests/train/test_data.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

from fsdp_workflow.core.exit_codes import EXIT_NONFINITE

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]

DIVERGES = ["data=synthetic", "train.seq_len=64", "optimizer.lr=1e6", "train.max_steps=30",
            "checkpoint.every_steps=1", "checkpoint.keep_last=0"]


def test_a_diverging_slurm_run_fails_and_its_consolidation_never_runs(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc = ph.run_cli(run_dir, *DIVERGES)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    ids = ph.jobs(run_dir)
    try:
        train = su.wait_for_job(ids["train"], timeout_s=180)
        cons = su.wait_for_job(ids["consolidate"], timeout_s=60)
    finally:
        ph.cancel_unfinished(ids)
    log = ph.logs(run_dir)
    assert train["JobState"] == "FAILED" and train["Restarts"] == "0", (train, log)
    assert train["ExitCode"] == f"{EXIT_NONFINITE}:0", train  # the trainer's code, not srun's 1
    assert (cons["JobState"], cons["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), cons
    rec = json.loads((run_dir / "train_exit.json").read_text())
    step = rec["exit_code"] == EXIT_NONFINITE and rec["step"]
    assert step and f"at step {step}" in rec["reason"], rec
    assert "requeueing job" not in log and not (run_dir / ".requeue").exists(), log
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert f"step-{step}" not in names and all(int(n.split("-")[1]) < step for n in names), names
    assert not (run_dir / "hf_model").exists()
    # Never started: no start time or run time, no log of its own; status names the failure and the cancel.
    assert cons.get("StartTime") in (None, "Unknown", "None") or cons.get("RunTime") == "00:00:00", cons
    assert not (run_dir / "logs" / f"consolidate-{ids['consolidate']}.out").exists()
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)],
                        capture_output=True, text=True, check=True).stdout
    assert "failed" in st and "DependencyNeverSatisfied" in st, st
