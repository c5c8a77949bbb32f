"""``python -m fsdp_workflow.status`` against real Slurm jobs (no training: jobs held, then cancelled)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def _status(run_dir, *args):
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_status_follows_queued_then_cancelled_chain(slurm_cluster, tmp_path):
    run_dir = tmp_path / "st"
    # data=synthetic: no prepare job, so the training job heads the chain (held by begin=now+600)
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic",
                      "+cluster.additional_parameters.begin=now+600").returncode == 0
    subprocess.run(["bash", str(run_dir / "submit.sh")], check=True, capture_output=True, timeout=60)
    ids = ph.jobs(run_dir)
    st = json.loads(_status(run_dir, "--json"))
    by_role = {j["role"]: j for j in st["jobs"]}
    assert by_role["train"]["status"] == "queued" and by_role["train"]["reason"] == "BeginTime"
    assert by_role["consolidate"]["status"] == "queued" and by_role["consolidate"]["reason"] == "Dependency"
    assert st["latest_checkpoint_step"] is None and st["consolidated"] == "absent"

    (run_dir / "checkpoints" / "step-10").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-10" / ".metadata").write_bytes(b"")  # complete: DCP wrote .metadata last
    (run_dir / "checkpoints" / "step-15").mkdir()  # no .metadata: not a checkpoint, by the trainer's own rule
    (run_dir / "checkpoints" / "step-20.tmp").mkdir()
    su.scancel(ids["train"])
    su.wait_for_job(ids["consolidate"], timeout_s=60)
    text = _status(run_dir)
    assert f"train        {ids['train']:>8}  cancelled" in text
    assert "DependencyNeverSatisfied" in text
    assert "latest checkpoint: step 10" in text


def test_status_of_a_run_dir_never_submitted(tmp_path):
    run_dir = tmp_path / "plan"
    assert ph.run_cli(run_dir, "dry_run=true").returncode == 0
    assert "nothing was submitted" in _status(run_dir)
    bad = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
