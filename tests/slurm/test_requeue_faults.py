"""Requeue storms on the real local Slurm (issue 14, item 6): ``cluster.max_requeues`` bounds every route.

    python -m pytest tests/slurm/test_requeue_faults.py

train.sbatch requeues itself after a checkpoint on a signal only while
``SLURM_RESTART_COUNT < cluster.max_requeues``; Slurm can requeue a job on its
own too (preemption with PreemptMode=REQUEUE, node failure, ``scontrol
requeue``), bypassing that check, so the script also refuses to start a run past
the limit. Synthetic data (no prepare job), seq_len 64, a run far longer than
the test: only the requeue bound can end it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]

# Never finishes on its own within the test: the job can only end through the requeue bound.
ENDLESS = ["data=synthetic", "train.seq_len=64", "train.max_steps=100000", "checkpoint.every_steps=0",
           "train.log_every_steps=1"]
RUN_START = "[fsdp_workflow] train job {job} restart {k}/{limit} nodes"  # train.sbatch, every run it starts
REFUSED = "requeued more often than cluster.max_requeues=1 allows"  # train.sbatch's guard


def test_requeue_storm_past_max_requeues_fails_and_cancels_consolidation(slurm_cluster, tmp_path):
    """max_requeues=1, preempted twice: first by USR2 (the trainer checkpoints, the script requeues
    itself: restart 1/1), then by an external ``scontrol requeue`` (Slurm's own route: restart 2/1).
    The third run refuses to start: FAILED with the message, consolidation CANCELLED, status shows
    the count. Without the guard the third run would train on and the job never end."""
    run_dir = tmp_path / "run storm"
    proc = ph.run_cli(run_dir, *ENDLESS, "cluster.max_requeues=1")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    ids = ph.jobs(run_dir)
    job, nodes = ids["train"], slurm_cluster.nodes
    try:
        # 1st preemption, the signal route: checkpoint, .requeue, the script requeues (0 < 1).
        ph.wait_for_log_text(run_dir, job, "step 1/", timeout_s=120)
        subprocess.run(["scancel", "--signal=USR2", str(job)], check=True)
        assert ph.release_after_requeue(job, nodes)["Restarts"] == "1"
        saved = int((run_dir / ".requeue").read_text().split()[1])

        # 2nd preemption, Slurm's own route, once the rerun has resumed and trains again.
        log = ph.wait_for_log_text(run_dir, job, "resumed from ", timeout_s=120)
        assert f"step-{saved} at step {saved}" in log, log[-3000:]
        ph.wait_for_log_text(run_dir, job, f"step {saved + 1}/", timeout_s=60)
        su.requeue(job)
        assert ph.release_after_requeue(job, nodes)["Restarts"] == "2"

        # The 3rd run is past the limit: it fails before starting anything.
        t0 = time.monotonic()
        train = su.wait_for_job(job, timeout_s=30)
        ended_s = time.monotonic() - t0
        cons = su.wait_for_job(ids["consolidate"], timeout_s=60)
    finally:
        ph.cancel_unfinished(ids)
    log = ph.logs(run_dir, tail_chars=0)
    assert (train["JobState"], train["Restarts"], train["ExitCode"]) == ("FAILED", "2", "1:0"), (train, log)
    # The refused run's own time in the job (Slurm's StartTime to EndTime of this last run), not the
    # scheduler's delay before starting it: a run that got as far as importing torch would take longer.
    run_s = (datetime.fromisoformat(train["EndTime"]) - datetime.fromisoformat(train["StartTime"])).total_seconds()
    assert run_s < 20, f"the refused run took {run_s:.0f} s ({ended_s:.0f} s after the release) to end"
    assert (cons["JobState"], cons["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), cons
    assert not (run_dir / "hf_model").exists()
    # Two runs started and trained, the third was refused with the limit, the key and the way on.
    assert [log.count(RUN_START.format(job=job, k=k, limit=1)) for k in (0, 1, 2)] == [1, 1, 0], log
    refusal = next(l for l in log.splitlines() if REFUSED in l)
    assert f"train job {job} restart 2/1:" in refusal and "checkpoint.resume=auto" in refusal, refusal
    assert log.count("[fsdp_workflow] host ") == 2, log  # train_node.sh ran in the two runs only
    assert "restart 3/" not in log and log.count("requeueing job") == 1, log

    text = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)],
                          capture_output=True, text=True, check=True).stdout
    assert f"train        {job:>8}  failed" in text and "restarts 2 (cluster.max_requeues=1)" in text, text
    assert REFUSED in text, text
    st = json.loads(subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir), "--json"],
                                   capture_output=True, text=True, check=True).stdout)
    by_role = {j["role"]: j for j in st["jobs"]}
    assert (by_role["train"]["restarts"], by_role["train"]["max_requeues"]) == (2, 1), by_role
    assert (by_role["consolidate"]["status"], by_role["consolidate"]["reason"]) == (
        "cancelled", "DependencyNeverSatisfied"), by_role
