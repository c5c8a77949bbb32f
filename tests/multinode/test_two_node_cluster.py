"""The two-node test Slurm runs jobs that really span two hosts."""

from __future__ import annotations

import shlex
import sys
import textwrap

import pytest

import slurm_utils as su

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(120)]

ALL_REDUCE = textwrap.dedent("""\
    import os, socket
    import torch, torch.distributed as dist
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank, world_size=world,
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"RESULT host={socket.gethostname()} rank={rank} sum={t.item()}", flush=True)
    dist.destroy_process_group()
    """)


def test_cluster_info(two_node_cluster):
    assert two_node_cluster.nodes == ["n1", "n2"]
    assert two_node_cluster.partition == "debug"


def test_sbatch_gloo_all_reduce_across_nodes(tmp_path):
    (tmp_path / "ar.py").write_text(ALL_REDUCE)
    script = textwrap.dedent(f"""\
        #!/bin/bash
        export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
        export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
        echo "MASTER_ADDR=$MASTER_ADDR batch_host=$(hostname)"
        srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / "ar.py"))}
        """)
    log = tmp_path / "ar.out"
    job = su.sbatch("-N", "2", "--ntasks-per-node=1", "--mem=1G", "-t", "2", "-o", str(log), script=script)
    rec = su.wait_for_job(job, timeout_s=100)
    text = su.read_log(log)
    assert rec["JobState"] == "COMPLETED", (rec, text)
    assert su.hostnames(rec["NodeList"]) == ["n1", "n2"]
    assert "MASTER_ADDR=n1 batch_host=n1" in text
    results = sorted(l for l in text.splitlines() if l.startswith("RESULT"))
    assert results == ["RESULT host=n1 rank=0 sum=3.0", "RESULT host=n2 rank=1 sum=3.0"], text


def _rank_report():
    import socket

    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export()
    dist.init_process_group("gloo")
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"host": socket.gethostname(), "rank": env.rank, "world": env.world_size,
            "master": env.master_addr, "sum": t.item()}


def test_submitit_two_nodes(tmp_path):
    import submitit

    su.pickle_test_functions_by_value(__name__)
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(slurm_partition="debug", nodes=2, tasks_per_node=1, cpus_per_task=1,
                         slurm_mem="1G", timeout_min=5)
    job = ex.submit(_rank_report)
    results = sorted(job.results(), key=lambda r: r["rank"])
    assert [r["host"] for r in results] == ["n1", "n2"]
    assert all(r["master"] == "n1" and r["world"] == 2 and r["sum"] == 3.0 for r in results), results
    assert su.wait_for_job(job.job_id, timeout_s=30)["JobState"] == "COMPLETED"
