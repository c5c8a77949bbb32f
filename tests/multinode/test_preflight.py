"""The training job's preflight on the two-node Slurm (n1, n2): a bad node stops the job in seconds, named.

    python -m pytest -n 0 tests/multinode/test_preflight.py

Each run goes through the real CLI and submission (``train.sbatch`` runs
``srun --nodes=2 --ntasks-per-node=1 python -m fsdp_workflow.preflight`` before the
training step). The test-only hook ``FSDP_WORKFLOW_TEST_PREFLIGHT=KIND@n2``, carried
to the job by sbatch's environment, makes n2 lose the run directory or report
another torch version. The job must end with exit 66, its log naming n2, the check
and the fix, its exit record saying ``preflight``, no rank started, and the
consolidation job cancelled by its ``afterok`` dependency.

The good path (both nodes pass in seconds, then the ranks start) is asserted on the
two-node training run of tests/multinode/test_multinode_training.py, which runs the
preflight like every chain does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import slurm_utils as su

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TWO_NODES = ["cluster=slurm", "cluster.partition=debug", "cluster.nodes=2", "cluster.processes_per_node=1",
             "data=synthetic"]


def _submit(run_dir: Path, env: dict, *overrides: str) -> dict[str, int]:
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", f"run_dir={run_dir}", *TWO_NODES, *overrides]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return {role: int(job_id) for role, job_id in
            (line.split()[:2] for line in (run_dir / "jobs.txt").read_text().splitlines() if line.strip())}


def _failed_preflight(two_node_cluster, run_dir: Path, fault: str) -> str:
    """Submit with ``fault`` on n2; check what every failed preflight must show; return the training log."""
    env = {**two_node_cluster.env, "FSDP_WORKFLOW_TEST_PREFLIGHT": fault, "FSDP_WORKFLOW_TEST_PREFLIGHT_WAIT_S": "8"}
    ids = _submit(run_dir, env)
    train = su.wait_for_job(ids["train"], timeout_s=180, env=env)
    cons = su.wait_for_job(ids["consolidate"], timeout_s=60, env=env)
    log = su.read_log(run_dir / "logs" / f"train-{ids['train']}.out")
    assert (train["JobState"], train["ExitCode"]) == ("FAILED", "66:0"), log
    # afterok + kill-on-invalid-dep: Slurm cancels the consolidation, nothing stays queued
    assert (cons["JobState"], cons["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), cons
    record = json.loads((run_dir / "job_exits" / f"train-{ids['train']}.json").read_text())
    assert (record["exit_code"], record["cause"]) == (66, "preflight")
    assert "preflight failed (the lines above name the node, the check and the fix); nothing was trained" in log
    # no rank started: train_node.sh never ran, nothing was written
    assert "node_rank" not in log and not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
    status = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, env=env)
    assert "preflight failed" in status.stdout + status.stderr, status.stdout + status.stderr
    return log


def test_a_node_that_cannot_see_the_run_directory(two_node_cluster, tmp_path):
    run_dir = tmp_path / "no run dir on n2"
    log = _failed_preflight(two_node_cluster, run_dir, "no_run_dir@n2")
    # n2 says it itself, and n1 (which sees the others' facts) names n2 and the fix
    assert "preflight failed on n2 (node 1): run directory: this node cannot write in the run directory" in log
    assert "preflight failed on n2 (node 1): run directory: no facts from this node in" in log
    assert "Fix: put the run directory on a filesystem every node mounts at the same path" in log
    assert "preflight n1 (node 0): run directory ok" in log


def test_a_node_with_another_torch_version(two_node_cluster, tmp_path):
    run_dir = tmp_path / "other version on n2"
    log = _failed_preflight(two_node_cluster, run_dir, "version@n2")
    line = next(x for x in log.splitlines() if "preflight failed on" in x)
    assert line.startswith("[fsdp_workflow] preflight failed on n2 (node 1): versions: it runs torch ")
    assert "+test-other-version, n1 (node 0) runs torch " in line and "Fix: give every node the same software" in line
    # the facts of a failed preflight stay for a look
    train_id = _job_id(run_dir)
    facts = json.loads((run_dir / ".preflight" / f"{train_id}.0" / "node-1.json").read_text())
    assert facts["host"] == "n2" and facts["torch"].endswith("+test-other-version")


def _job_id(run_dir: Path) -> int:
    return next(int(line.split()[1]) for line in (run_dir / "jobs.txt").read_text().splitlines()
                if line.startswith("train "))
