"""A requeued training job that lands on another node resumes there (issue 14, item 7).

    python -m pytest tests/multinode/test_requeue_node.py

On the two-node cluster (tools/slurm/two_node_cluster.sh): a 1-node job trains
on one node, is preempted (USR2: checkpoint, ``.requeue``, the script requeues
itself), is kept off that node (``scontrol update ExcNodeList``), runs on the
other, resumes from the checkpoint and finishes; the chain's consolidation then
runs. Host names and the rendezvous come from Slurm's variables on each run,
never from the first node of the cluster or of an earlier run.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(240)]

# A few seconds of steps: the signal lands mid-run, and the rerun has most of the run left.
ONE_NODE = ["cluster.nodes=1", "cluster.processes_per_node=1", "data=synthetic", "train.seq_len=64",
            "train.max_steps=200", "checkpoint.every_steps=0", "train.log_every_steps=1"]
# train.sbatch at every start, and train_node.sh once per node and run.
RUN_LINE = re.compile(r"^\[fsdp_workflow\] train job (?P<job>\d+) restart (?P<k>\d+)/\d+ nodes (?P<nodes>\S+) "
                      r"master (?P<master>\S+)$", re.M)
NODE_LINE = re.compile(r"^\[fsdp_workflow\] host (?P<host>\S+) node_rank (?P<node>\d+) of (?P<nnodes>\d+) "
                       r"master (?P<master>\S+)$", re.M)
RANK_HOST = re.compile(r"^\[fsdp_workflow\] rank 0 of 1 \(node 0, local rank 0\) host (?P<host>\S+) ", re.M)


def test_requeued_job_excluded_from_its_node_resumes_on_the_other(two_node_cluster, tmp_path):
    run_dir = tmp_path / "run moved"
    proc = ph.run_cli(run_dir, *ONE_NODE)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    ids = ph.jobs(run_dir)
    job = ids["train"]
    try:
        ph.wait_for_log_text(run_dir, job, "step 1/", timeout_s=120)
        first = su.show_job(job)["NodeList"]
        assert first in two_node_cluster.nodes
        (other,) = [n for n in two_node_cluster.nodes if n != first]
        subprocess.run(["scancel", "--signal=USR2", str(job)], check=True)
        su.wait_for_state(job, {"PENDING"}, timeout_s=120)
        su.exclude_nodes(job, [first])  # as if the node had been drained for repair
        assert ph.release_after_requeue(job, two_node_cluster.nodes)["Restarts"] == "1"
        train = su.wait_for_job(job, timeout_s=150)
        cons = su.wait_for_job(ids["consolidate"], timeout_s=90)
    finally:
        ph.cancel_unfinished(ids)
    log = ph.logs(run_dir, tail_chars=0)
    assert (train["JobState"], train["NodeList"], train["ExcNodeList"]) == ("COMPLETED", other, first), (train, log)
    assert cons["JobState"] == "COMPLETED", (cons, log)

    # Each run took its host and rendezvous from its own allocation.
    port = 20000 + job % 10000
    runs = [(m["k"], m["nodes"], m["master"]) for m in RUN_LINE.finditer(log)]
    assert runs == [("0", first, f"{first}:{port}"), ("1", other, f"{other}:{port}")], log
    nodes = [(m["host"], m["node"], m["nnodes"], m["master"]) for m in NODE_LINE.finditer(log)]
    assert nodes == [(first, "0", "1", f"{first}:{port}"), (other, "0", "1", f"{other}:{port}")], log
    assert RANK_HOST.findall(log) == [first, other], log

    # The rerun on the other node resumed from the first run's checkpoint and finished the run.
    resumed = re.findall(r"resumed from (.+?) at step (\d+)\s*$", log, re.M)
    assert len(resumed) == 1, log
    path, step = resumed[0]
    assert path == str(run_dir / "checkpoints" / f"step-{step}") and 0 < int(step) < 200, resumed
    assert "requeueing job" in log
    assert [m["step"] for m in ph.metrics(run_dir)] == list(range(1, 201))
    assert json.loads((run_dir / "train_exit.json").read_text())["step"] == 200
    assert json.loads((run_dir / "hf_model" / "verification.json").read_text()).get("ok") is True
