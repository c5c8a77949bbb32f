"""``submit.sh`` from a fresh login shell: the jobs run the interpreter and environment that planned.

``env -i`` leaves only ``PATH`` (the system's, where Slurm's commands are, and no venv) and
``SLURM_CONF``. Without the recorded interpreter the preparation job ran whichever
``python`` that PATH finds (here none; on a login node often one without the project's
packages: ``ModuleNotFoundError``). Also: a consolidation's staging directory left by an
earlier, killed run is removed by the next consolidation job (nothing left behind).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(400)]


def test_submit_sh_under_env_i_runs_the_planning_interpreter(slurm_cluster, tmp_path):
    run_dir = tmp_path / "fresh shell"
    assert ph.run_cli(run_dir, "dry_run=true", "name=fresh1").returncode == 0
    debris = run_dir / ".hf_model.tmp-4242"  # what a requeued or killed consolidation leaves
    (debris / "part").mkdir(parents=True)
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], capture_output=True, text=True)
    assert f"left behind: {debris}" in st.stdout, st.stdout
    proc = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", f"SLURM_CONF={slurm_cluster.slurm_conf}",
                           "bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = ph.jobs(run_dir)
    try:
        for role in ("prepare", "train", "consolidate"):
            rec = su.wait_for_job(ids[role], timeout_s=240)
            assert rec["JobState"] == "COMPLETED", (role, rec, ph.logs(run_dir))
    finally:
        ph.cancel_unfinished(ids)
    ph.load_consolidated(run_dir / "hf_model")
    assert not debris.exists()
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], capture_output=True, text=True)
    assert "left behind" not in st.stdout, st.stdout
    # the same command again: complete, nothing submitted
    again = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", f"SLURM_CONF={slurm_cluster.slurm_conf}",
                            "bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "this run is complete" in again.stdout, again.stdout + again.stderr
    assert ph.jobs(run_dir) == ids
