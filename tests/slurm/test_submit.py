"""Submission failures on the real local Slurm: nothing is left half-submitted."""

from __future__ import annotations

import subprocess

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def _train_ids_named(name: str) -> list:
    out = su._run(["squeue", "-h", "-n", name, "-o", "%i"]).stdout.split()
    return [int(x) for x in out]


def test_cli_refused_consolidation_cancels_the_training_job(slurm_cluster, tmp_path):
    run_dir = tmp_path / "refused"
    # data=synthetic: no prepare job, so the chain is training then consolidation
    # cluster.check_limits=false: sbatch itself refuses (the cluster checks would refuse first, exit 2,
    # tests/slurm/test_cluster_checks.py); what is tested here is that nothing stays half-submitted.
    proc = ph.run_cli(run_dir, "data=synthetic", "cluster.consolidate_partition=nosuchpartition", "name=refused1",
                      "cluster.check_limits=false")
    # reported like a config problem: the key that set the option, exit 2
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "fsdp_workflow: invalid config" in proc.stderr
    assert "cluster.consolidate_partition = 'nosuchpartition'" in proc.stderr
    assert "sbatch refused the consolidation job" in proc.stderr
    assert "invalid partition" in proc.stderr.lower()
    assert "was submitted; cancelled it" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run_dir / "jobs.txt").exists()
    train_id = int(proc.stderr.split("The training job ")[1].split()[0])
    assert su.wait_for_job(train_id, timeout_s=60)["JobState"] == "CANCELLED"


def test_cli_refused_training_names_the_problem(slurm_cluster, tmp_path):
    proc = ph.run_cli(tmp_path / "r", "cluster.partition=nosuchpartition", "cluster.consolidate_partition=debug",
                      "cluster.check_limits=false")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.partition = 'nosuchpartition'" in proc.stderr
    assert "sbatch refused the training job" in proc.stderr and "partition" in proc.stderr.lower()
    # the data preparation job, submitted first, does not stay behind
    prep_id = int(proc.stderr.split("The data preparation job ")[1].split()[0])
    assert su.wait_for_job(prep_id, timeout_s=60)["JobState"] == "CANCELLED"
    assert "Traceback" not in proc.stderr


def test_cli_sbatch_memory_refusal_names_the_key(slurm_cluster, tmp_path):
    """Memory over every node: sbatch's refusal is told as cluster.mem_gb, exit 2, nothing left queued."""
    proc = ph.run_cli(tmp_path / "mem", "data=synthetic", "cluster.mem_gb=100000", "name=refusedmem",
                      "cluster.check_limits=false")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.mem_gb = 100000" in proc.stderr and "sbatch refused the training job" in proc.stderr
    assert "fix: set cluster.mem_gb to" in proc.stderr
    assert _train_ids_named("refusedmem-train") == []


def test_submit_sh_refused_consolidation_cancels_the_training_job(slurm_cluster, tmp_path):
    run_dir = tmp_path / "refused sh"
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "cluster.consolidate_partition=nosuchpartition",
                      "name=refused2").returncode == 0
    proc = subprocess.run(["bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cancelling training job" in proc.stderr
    assert not (run_dir / "jobs.txt").exists()
    train_id = int(proc.stderr.split("cancelling training job ")[1].split()[0])
    assert su.wait_for_job(train_id, timeout_s=60)["JobState"] == "CANCELLED"
