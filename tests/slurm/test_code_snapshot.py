"""The chain runs the code that was submitted, not the checkout as it is when the jobs start.

    python -m pytest tests/slurm/test_code_snapshot.py

A copy of the package submits the smoke chain (``PYTHONPATH=<copy>``, as a user's
checkout would); the training job is held; the copy is broken (the trainer's loop
module deleted, as a branch switch or an edit in progress would); the job is
released. The whole chain completes from ``RUN_DIR/code``, and the trainer's log
names that copy as the code it ran.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_held_job_runs_the_snapshot_after_the_checkout_breaks(slurm_cluster, tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(ph.ROOT / "fsdp_workflow", checkout / "fsdp_workflow",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", *ph.SMOKE, f"run_dir={run_dir}",
            "train.max_steps=4", "checkpoint.every_steps=4"]
    env = ph.env_with(PYTHONPATH=str(checkout))
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    ids = ph.jobs(run_dir)
    try:
        su._run(["scontrol", "hold", str(ids["train"])])
        prov = json.loads((run_dir / "provenance.json").read_text())
        snap = prov["code_snapshot"]
        assert snap["source"] == str(checkout / "fsdp_workflow") and snap["path"] == str(run_dir / "code" / "fsdp_workflow")
        assert (run_dir / "code" / "fsdp_workflow" / "train" / "loop.py").is_file()
        assert not list((run_dir / "code").rglob("__pycache__"))

        (checkout / "fsdp_workflow" / "train" / "loop.py").unlink()  # the checkout no longer trains
        su._run(["scontrol", "release", str(ids["train"])])
        cons = su.wait_for_job(ids["consolidate"], timeout_s=240)
    finally:
        ph.cancel_unfinished(ids)
    train = su.show_job(ids["train"]) or {}
    assert cons["JobState"] == "COMPLETED", (train, cons, ph.logs(run_dir))
    log = (run_dir / "logs" / f"train-{ids['train']}.out").read_text()
    assert f"code: {run_dir / 'code' / 'fsdp_workflow'}" in log, log
    assert json.loads((run_dir / "hf_model" / "verification.json").read_text())["ok"] is True

    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], capture_output=True, text=True,
                        timeout=60)
    assert f"code: snapshot {snap['sha256'][:12]} ({run_dir / 'code' / 'fsdp_workflow'})" in st.stdout, st.stdout
