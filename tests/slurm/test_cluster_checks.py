"""The chain against the real test Slurm's limits: refused before the queue, or cancelled when it would never start.

Each test sets the limits it needs at run time: a partition ``short<pid>`` with
``MaxTime=5`` (``scontrol create``, deleted in teardown), a QoS with a MaxWall
(``sacctmgr add qos``, deleted in teardown). Every refusal exits 2 and leaves no
job of the chain in the queue (``squeue -n <name>-<role>``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]
ROLES = ("prepare", "train", "consolidate")


@pytest.fixture
def short(slurm_cluster):
    """A partition over every node with MaxTime=5 minutes; deleted afterwards."""
    name = f"short{os.getpid() % 100000}"
    su._run(["scontrol", "create", f"PartitionName={name}", "Nodes=ALL", "MaxTime=5"])
    yield name
    su._run(["scancel", "-p", name], check=False)  # a failing test may have left jobs there
    for _ in range(60):  # a partition with jobs in it cannot be deleted
        if su._run(["scontrol", "delete", f"PartitionName={name}"], check=False).returncode == 0:
            break
        time.sleep(0.5)


@pytest.fixture
def node(slurm_cluster) -> dict:
    return su.parse_scontrol_record(su._run(["scontrol", "show", "node", "-o"]).stdout.splitlines()[0])


def _queued(name: str) -> list:
    """Jobs of the chain named ``name`` that squeue still lists (pending or running)."""
    names = ",".join(f"{name}-{r}" for r in ROLES)
    return su._run(["squeue", "-h", "-n", names, "-o", "%i %T %r"]).stdout.split("\n")[:-1]


def _refused(tmp_path: Path, name: str, *overrides: str) -> str:
    proc = ph.run_cli(tmp_path / name, f"name={name}", *overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "fsdp_workflow: invalid config" in proc.stderr and "Traceback" not in proc.stderr
    assert _queued(name) == []
    assert not (tmp_path / name / "jobs.txt").exists()
    return proc.stderr


def test_time_over_the_partitions_maxtime(short, tmp_path):
    err = _refused(tmp_path, "ccTime", f"cluster.partition={short}", "cluster.time_min=30",
                   "cluster.consolidate_partition=debug")
    assert "cluster.time_min = 30" in err and f"partition '{short}': MaxTime=5 min" in err
    assert "fix: cluster.time_min=5 or less, or a partition that allows it: debug" in err
    assert "nothing was submitted" in err


def test_more_nodes_than_the_partition_has(slurm_cluster, tmp_path):
    err = _refused(tmp_path, "ccNodes", "cluster.nodes=3")
    assert "cluster.nodes = 3" in err and "partition 'debug' has 1 (TotalNodes" in err


def test_more_cpus_than_any_node(slurm_cluster, node, tmp_path):
    cpus = int(node["CPUTot"])
    err = _refused(tmp_path, "ccCpus", f"cluster.cpus_per_task={cpus + 8}")
    assert f"cluster.cpus_per_task = {cpus + 8}" in err and f"CPUTot={cpus}" in err
    assert f"fix: cluster.cpus_per_task={cpus} or less" in err


def test_memory_over_the_node(slurm_cluster, node, tmp_path):
    gb = int(node["RealMemory"]) // 1024 + 100
    err = _refused(tmp_path, "ccMem", f"cluster.consolidate_mem_gb={gb}")
    assert f"cluster.consolidate_mem_gb = {gb}" in err and f"RealMemory={node['RealMemory']} MB" in err
    assert "data preparation and consolidation jobs ask" in err


def test_unknown_partition_lists_the_partitions(short, tmp_path):
    err = _refused(tmp_path, "ccNope", "cluster.partition=nope")
    assert "cluster.partition = 'nope'" in err and "does not exist" in err
    assert "debug (MaxTime=UNLIMITED" in err and f"{short} (MaxTime=5 min" in err


def test_unknown_constraint_names_the_features(slurm_cluster, tmp_path):
    err = _refused(tmp_path, "ccFeat", "cluster.constraint=nosuchfeature")
    assert "cluster.constraint = 'nosuchfeature'" in err and "no node of partition 'debug' has it" in err


def test_unknown_qos_and_account_list_what_exists(slurm_cluster, tmp_path):
    err = _refused(tmp_path, "ccQos", "cluster.qos=nope", "cluster.account=nope")
    assert "cluster.account = 'nope'" in err and "one of your accounts: root" in err


@pytest.fixture
def qos10(slurm_cluster):
    name = f"wall{os.getpid() % 100000}"
    su._run(["sacctmgr", "-i", "add", "qos", name, "MaxWall=00:10:00"])
    yield name
    su._run(["sacctmgr", "-i", "delete", "qos", name], check=False)


def _check_cmd(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow.check", str(run_dir)], cwd=ph.ROOT,
                          capture_output=True, text=True, timeout=60)


def test_qos_maxwall_and_the_check_command_on_a_dry_run(qos10, short, tmp_path):
    # The test cluster does not enforce QoS limits (AccountingStorageEnforce=none): a warning, exit 0.
    run = tmp_path / "qos run"
    proc = ph.run_cli(run, "dry_run=true", f"cluster.qos={qos10}", "cluster.time_min=20")
    assert proc.returncode == 0, proc.stderr
    proc = _check_cmd(run)
    assert proc.returncode == 0, proc.stderr
    assert f"QoS '{qos10}': MaxWall=10 min (sacctmgr show qos); not enforced here" in proc.stderr
    assert "cluster checks passed on fsdplocal" in proc.stdout
    # a dry run planned for a partition it does not fit: the check command refuses it, naming the key
    bad = tmp_path / "bad"
    assert ph.run_cli(bad, "dry_run=true", f"cluster.partition={short}", "cluster.time_min=30").returncode == 0
    proc = _check_cmd(bad)
    assert proc.returncode == 2 and "cluster.time_min = 30" in proc.stderr
    assert _check_cmd(tmp_path / "nothing here").returncode == 2


@pytest.mark.slow  # a whole chain: its module is handed out with the long groups (tests/conftest.py)
def test_a_never_pending_reason_cancels_the_whole_chain(short, tmp_path):
    # With the pre-check off, Slurm takes the chain and gives the head PartitionTimeLimit at once:
    # the submission reads it, cancels every job and exits 2.
    name = "ccNever"
    proc = ph.run_cli(tmp_path / name, f"name={name}", "cluster.check_limits=false", f"cluster.partition={short}",
                      "cluster.time_min=30", "cluster.consolidate_time_min=30")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "PENDING (PartitionTimeLimit)" in err and "partition's MaxTime" in err
    assert "cluster.consolidate_time_min = 30" in err  # the prepare job heads the chain
    assert "cancelled the whole chain" in err
    ids = [int(x) for x in err.split("cancelled the whole chain (")[1].split(")")[0].split(", ")]
    assert len(ids) == 3
    assert _queued(name) == []
    assert all(su.show_job(i)["JobState"] == "CANCELLED" for i in ids)
    assert not (tmp_path / name / "jobs.txt").exists()

    # The same chain through `bash submit.sh` (no Python): the shell's watch cancels it too.
    sub = tmp_path / f"{name} sh"
    proc = ph.run_cli(sub, f"name={name}", "cluster.check_limits=false", f"cluster.partition={short}",
                      "cluster.time_min=30", "cluster.consolidate_time_min=30", "dry_run=true")
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(["bash", str(sub / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "submit.sh: Slurm would never start this chain:" in err, err
    assert "data preparation job " in err and ": PENDING (PartitionTimeLimit): the job's time limit is above its " \
        "partition's MaxTime; fix: lower the job's time (cluster.time_min, cluster.consolidate_time_min)" in err, err
    assert "cancelled the whole chain (" in err
    ids = [int(x) for x in err.split("cancelled the whole chain (")[1].split(")")[0].split(", ")]
    assert len(ids) == 3
    deadline = time.monotonic() + 20
    while _queued(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _queued(name) == []
    assert all(su.show_job(i)["JobState"] == "CANCELLED" for i in ids)
    assert not (sub / "jobs.txt").exists() and "follow:" not in proc.stdout
