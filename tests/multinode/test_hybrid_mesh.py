"""Hybrid sharding across two Slurm nodes: mesh dp_replicate 2 x dp_shard 1 (issue 15).

    python -m pytest tests/multinode/test_hybrid_mesh.py

``strategy.dp_replicate_size=2`` on 2 nodes x 1 process: each node holds a whole
replica (FSDP2 over a 2-D ``(dp_replicate, dp_shard)`` mesh, i.e. HSDP), the
gradients are all-reduced across the nodes, and each node trains on its own
half of every global batch. Through the real CLI, ``sbatch``, ``train_node.sh``
and ``torchrun --nnodes=2``, then the dependent consolidation job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

import slurm_utils as su

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
HYBRID = ["cluster=slurm", "cluster.partition=debug", "cluster.nodes=2", "cluster.processes_per_node=1",
          "strategy.dp_replicate_size=2", "train.max_steps=4", "checkpoint.every_steps=4"]


@pytest.fixture(scope="module")
def hybrid_run(two_node_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hybrid mesh") / "run"
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", f"run_dir={run_dir}", *HYBRID]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, env=two_node_cluster.env)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    ids = {role: int(job) for role, job in (line.split()[:2] for line in
                                            (run_dir / "jobs.txt").read_text().splitlines() if line.strip())}
    train = su.wait_for_job(ids["train"], timeout_s=150, env=two_node_cluster.env)
    cons = su.wait_for_job(ids["consolidate"], timeout_s=90, env=two_node_cluster.env)
    log = su.read_log(run_dir / "logs" / f"train-{ids['train']}.out")
    return {"run_dir": run_dir, "train": train, "consolidate": cons, "log": log}


def test_replicas_on_each_node_train_and_consolidate(hybrid_run) -> None:
    run_dir, log = hybrid_run["run_dir"], hybrid_run["log"]
    assert (hybrid_run["train"]["JobState"], hybrid_run["consolidate"]["JobState"]) == ("COMPLETED", "COMPLETED"), log
    assert su.hostnames(hybrid_run["train"]["NodeList"]) == ["n1", "n2"]
    assert "mesh dp_replicate 2 x dp_shard 1 x cp 1 x tp 1" in log, log
    env = (run_dir / "launch.env").read_text()
    assert "PARALLELISM_CONFIG_DP_REPLICATE_SIZE=2" in env and "PARALLELISM_CONFIG_DP_SHARD_SIZE=1" in env

    # Two data-parallel ranks: 2 x micro-batch 2 samples per step, each node its own half.
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [(r["step"], r["samples_consumed"]) for r in recs] == [(s, 4 * s) for s in range(1, 5)]
    assert recs[-1]["loss"] < recs[0]["loss"]

    # Replicated, not sharded: every weight is one whole chunk (DCP writes a replica once).
    md = FileSystemReader(str(run_dir / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    q = md["model.model.layers.0.self_attn.q_proj.weight"]
    assert [tuple(c.sizes) for c in q.chunks] == [tuple(q.size)] == [(64, 64)]
    assert json.loads((run_dir / "hf_model" / "verification.json").read_text()).get("ok") is True
