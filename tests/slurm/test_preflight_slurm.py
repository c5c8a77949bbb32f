"""The training job's preflight on the local single-node Slurm: a node that cannot see the run directory
ends the job with 66 and cancels the consolidation.

That a good preflight passes and training follows is asserted on the completed chain of
tests/slurm/test_api.py (every chain runs the preflight; no chain of its own for it).

    python -m pytest -n 0 tests/slurm/test_preflight_slurm.py

The failures across two nodes (a missing run directory, another torch version) are
tests/multinode/test_preflight.py.
"""

from __future__ import annotations

import json
import socket

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]
SHORT = ["data=synthetic", "train.max_steps=2", "optimizer.warmup_steps=0", "checkpoint.every_steps=0"]


def test_a_failed_preflight_ends_the_job_with_66_and_cancels_consolidation(slurm_cluster, tmp_path, monkeypatch):
    # the hook travels to the job in sbatch's environment (--export=ALL, Slurm's default)
    host = socket.gethostname().split(".")[0]
    monkeypatch.setenv("FSDP_WORKFLOW_TEST_PREFLIGHT", f"no_run_dir@{host}")
    run_dir = tmp_path / "bad"
    proc = ph.run_cli(run_dir, *SHORT)
    assert proc.returncode == 0, proc.stderr
    ids = ph.jobs(run_dir)
    train = su.wait_for_job(ids["train"], timeout_s=180)
    cons = su.wait_for_job(ids["consolidate"], timeout_s=60)
    log = su.read_log(run_dir / "logs" / f"train-{ids['train']}.out")
    assert (train["JobState"], train["ExitCode"]) == ("FAILED", "66:0"), log
    assert (cons["JobState"], cons["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied")
    assert f"preflight failed on {host} (node 0): run directory: this node cannot write" in log
    assert "node_rank" not in log and not (run_dir / "metrics.jsonl").exists()
    record = json.loads((run_dir / "job_exits" / f"train-{ids['train']}.json").read_text())
    assert (record["exit_code"], record["cause"]) == (66, "preflight")
