"""Training that really spans two Slurm nodes (issue 7), on tools/slurm/two_node_cluster.sh.

    python -m pytest tests/multinode/test_multinode_training.py

The run goes through the real CLI and the real submission path (``sbatch
train.sbatch``: one task per node, each running ``train_node.sh`` ->
``torchrun --nnodes=2``), then the dependent consolidation job. The nodes n1 and n2 are network namespaces
joined by a bridge: the ranks meet over TCP at ``n1:<port from the job id>``,
exactly as on a real cluster, though they share this machine's CPUs, PID
namespace and filesystem.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_utils as su

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
# A short run: two checkpoints, so both a mid-run and the final save cross nodes.
SMALL = ["train.max_steps=12", "checkpoint.every_steps=6"]
TWO_NODES = ["cluster=slurm", "cluster.partition=debug", "cluster.nodes=2", "cluster.processes_per_node=1"]

# [fsdp_workflow] rank 1 of 2 (node 1, local rank 0) host n2 pid 1234 master n1:20002
RANK_LINE = re.compile(
    r"^\[fsdp_workflow\] rank (?P<rank>\d+) of (?P<world>\d+) \(node (?P<node>\d+), local rank (?P<local>\d+)\) "
    r"host (?P<host>\S+) pid (?P<pid>\d+) master (?P<master>\S+)$",
    re.M,
)
# [fsdp_workflow] host n2 node_rank 1 of 2 master n1:20002   (train_node.sh, once per node)
NODE_LINE = re.compile(r"^\[fsdp_workflow\] host (?P<host>\S+) node_rank (?P<node>\d+) of (?P<nnodes>\d+) "
                       r"master (?P<master>\S+)$", re.M)


def run_cli(run_dir: Path, *overrides: str, env: dict | None = None, timeout_s: float = 180) -> None:
    """``python -m fsdp_workflow +experiment=smoke ...``; fails the test with the CLI's output."""
    argv = [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", f"run_dir={run_dir}", *overrides]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def jobs(run_dir: Path) -> dict[str, int]:
    """role -> job id, from RUN_DIR/jobs.txt."""
    return {role: int(job_id) for role, job_id in
            (line.split()[:2] for line in (run_dir / "jobs.txt").read_text().splitlines() if line.strip())}


def train_logs(run_dir: Path, job_id: int) -> str:
    """The training job's log: every node's task writes into train-<id>.out (srun's default)."""
    return su.read_log(run_dir / "logs" / f"train-{job_id}.out")


def all_logs(run_dir: Path) -> str:
    parts = [f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run_dir / "logs").rglob("*.out"))]
    return "\n".join(parts)


def rank_lines(text: str) -> dict[int, dict[str, str]]:
    return {int(m["rank"]): m.groupdict() for m in RANK_LINE.finditer(text)}


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def expected_master(job_id: int) -> str:
    """The rendezvous endpoint the plan promises: first host, 20000 + id % 10000 (schema defaults)."""
    return f"n1:{20000 + job_id % 10000}"


# --------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def two_node_run(two_node_cluster, tmp_path_factory):
    """The smoke run on n1 + n2 (1 rank each), through the CLI; waits for training and consolidation."""
    run_dir = tmp_path_factory.mktemp("two node run") / "run"
    t0 = time.monotonic()
    run_cli(run_dir, *TWO_NODES, *SMALL, env=two_node_cluster.env)
    ids = jobs(run_dir)
    train = su.wait_for_job(ids["train"], timeout_s=150, env=two_node_cluster.env)
    cons = su.wait_for_job(ids["consolidate"], timeout_s=90, env=two_node_cluster.env)
    return {"run_dir": run_dir, "ids": ids, "train": train, "consolidate": cons,
            "wall_s": time.monotonic() - t0}


@pytest.fixture(scope="module")
def single_node_run(tmp_path_factory):
    """The same config and seed on one node with 2 processes (cluster=local: torchrun on this host)."""
    run_dir = tmp_path_factory.mktemp("single node run") / "run"
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    run_cli(run_dir, "cluster=local", "cluster.nodes=1", "cluster.processes_per_node=2", *SMALL, env=env)
    return run_dir


# --------------------------------------------------------------------------- tests


def test_fsdp2_training_spans_both_nodes(two_node_run):
    """Both jobs complete; rank 0 ran on n1 and rank 1 on n2, each with the right node rank,
    world size and rendezvous endpoint; every checkpoint holds one shard per rank."""
    run_dir, ids = two_node_run["run_dir"], two_node_run["ids"]
    assert two_node_run["train"]["JobState"] == "COMPLETED", all_logs(run_dir)
    assert two_node_run["consolidate"]["JobState"] == "COMPLETED", all_logs(run_dir)
    assert su.hostnames(two_node_run["train"]["NodeList"]) == ["n1", "n2"]

    text = train_logs(run_dir, ids["train"])
    master = expected_master(ids["train"])
    # The preflight passed on both nodes before torchrun started, and left no facts behind
    # (its failures: tests/multinode/test_preflight.py).
    assert "preflight passed on 2 node(s)" in text and "GPUs skipped (cluster.device=cpu)" in text, text
    assert text.index("preflight passed") < text.index("node_rank")
    assert {"n1 (node 0)", "n2 (node 1)"} <= {x.split(": run directory ok")[0].split("preflight ")[-1]
                                              for x in text.splitlines() if ": run directory ok" in x}
    assert not list((run_dir / ".preflight").rglob("node-*.json"))
    nodes = {m["host"]: m.groupdict() for m in NODE_LINE.finditer(text)}
    assert set(nodes) == {"n1", "n2"}, text
    assert [(h, nodes[h]["node"], nodes[h]["nnodes"], nodes[h]["master"]) for h in ("n1", "n2")] == [
        ("n1", "0", "2", master), ("n2", "1", "2", master)], text

    ranks = rank_lines(text)
    placement = {r: (v["host"], v["node"], v["local"], v["world"], v["master"]) for r, v in ranks.items()}
    assert placement == {0: ("n1", "0", "0", "2", master), 1: ("n2", "1", "0", "2", master)}, text

    # FSDP2 across the nodes: each rank wrote its own shard of every checkpoint.
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert ckpts == ["step-12", "step-6"]
    for name in ckpts:
        files = sorted(p.name for p in (run_dir / "checkpoints" / name).iterdir())
        assert [f for f in files if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"], files
        assert ".metadata" in files
        assert all((run_dir / "checkpoints" / name / f).stat().st_size > 0 for f in files)
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, 13))
    assert json.loads((run_dir / "hf_model" / "verification.json").read_text()).get("ok") is True


def test_two_node_model_equals_single_node_model(two_node_run, single_node_run):
    """The consolidated model of the 2-node x 1 run is bit-identical to the 1-node x 2 run's.

    Exact, not a tolerance: measured max |difference| 0.0 over all 21 fp32 tensors
    (and identical per-step losses). Both runs have world size 2 with the same
    rank -> data shard mapping and per-(seed, step, rank) reseeding, and FSDP2's
    reduce-scatter / all-gather over gloo with two ranks sum two operands, which
    is order-independent. Any difference therefore means the two launches did
    not train the same thing (a wrong rank or world size, a lost shard).
    """
    from safetensors.torch import load_file

    two = load_file(two_node_run["run_dir"] / "hf_model" / "model.safetensors")
    one = load_file(single_node_run / "hf_model" / "model.safetensors")
    assert sorted(two) == sorted(one)
    diffs = {k: (two[k].float() - one[k].float()).abs().max().item() for k in two
             if two[k].dtype != one[k].dtype or two[k].shape != one[k].shape or not two[k].equal(one[k])}
    assert not diffs, f"tensors that differ (max abs diff): {diffs}"
    losses = lambda d: [m["loss"] for m in metrics(d)]  # noqa: E731
    assert losses(two_node_run["run_dir"]) == losses(single_node_run)


def test_submit_sh_two_nodes_two_ranks_each_hybrid_sharded(two_node_cluster, tmp_path):
    """The plain-sbatch chain (dry run, then ``bash submit.sh``) with 2 nodes x 2 ranks: the
    batch shell's rendezvous, and global ranks = node rank x 2 + local rank on the right hosts.

    The same run proves hybrid sharding (issue 15): ``strategy.dp_replicate_size=2`` gives the
    mesh dp_replicate 2 x dp_shard 2 (HSDP: each node holds a whole replica, sharded over its
    2 ranks; gradients all-reduced across the nodes), every rank trains on its own quarter of
    the global batch, the checkpoint holds each weight as 2 shards (DCP writes a replica once),
    and the dependent consolidation verifies.
    """
    env = two_node_cluster.env
    run_dir = tmp_path / "submit sh run"
    run_cli(run_dir, "cluster=slurm", "cluster.partition=debug", "cluster.nodes=2",
            "cluster.processes_per_node=2", "strategy.dp_replicate_size=2", "train.max_steps=4",
            "checkpoint.every_steps=4", "dry_run=true", env=env)
    launch_env = (run_dir / "launch.env").read_text()
    assert "PARALLELISM_CONFIG_DP_REPLICATE_SIZE=2" in launch_env and "PARALLELISM_CONFIG_DP_SHARD_SIZE=2" in launch_env
    proc = subprocess.run(["bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    ids = jobs(run_dir)
    train = su.wait_for_job(ids["train"], timeout_s=150, env=env)
    cons = su.wait_for_job(ids["consolidate"], timeout_s=90, env=env)
    log = su.read_log(run_dir / "logs" / f"train-{ids['train']}.out")
    assert (train["JobState"], cons["JobState"]) == ("COMPLETED", "COMPLETED"), all_logs(run_dir)

    master = expected_master(ids["train"])
    placement = {r: (v["host"], v["node"], v["local"], v["world"], v["master"]) for r, v in rank_lines(log).items()}
    assert placement == {
        0: ("n1", "0", "0", "4", master), 1: ("n1", "0", "1", "4", master),
        2: ("n2", "1", "0", "4", master), 3: ("n2", "1", "1", "4", master),
    }, log
    assert "mesh dp_replicate 2 x dp_shard 2 x cp 1 x tp 1" in log, log

    # Four data-parallel ranks: 4 x micro-batch samples per step, each rank its own part.
    recs = metrics(run_dir)
    micro = recs[0]["samples_consumed"] // 4
    assert micro >= 1 and [(r["step"], r["samples_consumed"]) for r in recs] == [(s, 4 * micro * s) for s in range(1, 5)]
    assert recs[-1]["loss"] < recs[0]["loss"]

    # Sharded within a node, replicated across nodes: every weight is 2 row blocks, each written once.
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(run_dir / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    q = md["model.model.layers.0.self_attn.q_proj.weight"]
    rows = q.size[0]
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in q.chunks) == [
        ((0, 0), (rows // 2, q.size[1])), ((rows // 2, 0), (rows // 2, q.size[1]))]
    assert json.loads((run_dir / "hf_model" / "verification.json").read_text()).get("ok") is True


def _netns_inode(path: str) -> int:
    return os.stat(path).st_ino


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _job_processes(job_id: int) -> list[int]:
    """PIDs of processes (any node: one PID namespace) whose environment names this Slurm job."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if _environ(int(p.name)).get("SLURM_JOB_ID") == str(job_id):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def _rank1_on_n2(run_dir: Path, train_id: int, env: dict, min_steps: int) -> int:
    """The pid of rank 1 once ``min_steps`` steps are logged, checked to be this job's rank 1 in n2's namespace."""
    deadline = time.monotonic() + 120
    victim = None
    while time.monotonic() < deadline:
        ranks = rank_lines(train_logs(run_dir, train_id))
        if 1 in ranks and len(metrics(run_dir)) >= min_steps:
            victim = int(ranks[1]["pid"])
            break
        assert su.job_state(train_id, env=env) in ("PENDING", "RUNNING"), all_logs(run_dir)
        time.sleep(0.5)
    assert victim is not None, f"rank 1 never reached step {min_steps}\n{all_logs(run_dir)}"
    assert ranks[1]["host"] == "n2"
    assert _netns_inode(f"/proc/{victim}/ns/net") == _netns_inode("/var/run/netns/n2")
    # The rank number is the process's own placement line; its environment at start is the job's.
    # (A rank forked by the node launcher, cluster.rank_start=auto on CPU, got RANK after its start,
    # which /proc/PID/environ does not show.)
    assert _environ(victim).get("SLURM_JOB_ID") == str(train_id)
    assert "fsdp_workflow.train" in Path(f"/proc/{victim}/cmdline").read_text()
    return victim


def test_killing_the_rank_on_n2_fails_the_job_promptly_and_cancels_consolidation(two_node_cluster, tmp_path):
    """SIGKILL the rank on n2 mid-run: torchrun on n2 exits non-zero, ``srun --kill-on-bad-exit``
    ends n1's task, the training job is FAILED within seconds (its time limit is 20 min),
    and the afterok consolidation is CANCELLED (DependencyNeverSatisfied) without running."""
    env = two_node_cluster.env
    run_dir = tmp_path / "failing run"
    # Long enough to be mid-run whenever the kill lands; rdzv timeout lowered so that
    # even a rank left waiting in a collective would give up within a minute.
    run_cli(run_dir, *TWO_NODES, "train.max_steps=20000", "checkpoint.every_steps=0",
            "cluster.rdzv_timeout_s=45", env=env)
    ids = jobs(run_dir)
    train_id, cons_id = ids["train"], ids["consolidate"]

    with su.cancelled_on_exit(ids.values(), env=env):  # a failure leaves no ranks spinning
        victim = _rank1_on_n2(run_dir, train_id, env, min_steps=10)
        steps_before = len(metrics(run_dir))

        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        rec = su.wait_for_job(train_id, timeout_s=90, env=env)
        ended_s = time.monotonic() - t_kill
        assert rec["JobState"] == "FAILED", (rec, all_logs(run_dir))
        assert ended_s < 60, f"training job took {ended_s:.0f} s after the kill to end\n{all_logs(run_dir)}"
        assert rec["TimeLimit"] == "00:20:00"
        assert len(metrics(run_dir)) < 20000 and steps_before >= 10

        cons = su.wait_for_state(cons_id, {"CANCELLED"}, timeout_s=30, env=env)
        assert cons["Reason"] == "DependencyNeverSatisfied", cons
        assert cons["StartTime"] in ("Unknown", "None") or cons["RunTime"] == "00:00:00", cons
        assert not (run_dir / "hf_model").exists()
        # Never ran: no task log, and accounting has no batch step for it.
        assert not list((run_dir / "logs").rglob(f"{cons_id}_*_log.*")), all_logs(run_dir)
        assert set(su.sacct_states(cons_id, env=env)) == {str(cons_id)}, su.sacct_states(cons_id, env=env)
        # Nothing of the job is left on either node (n1's rank was killed by srun, not orphaned).
        deadline = time.monotonic() + 20
        while (left := _job_processes(train_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes of job {train_id} still alive: {left}"
        print(f"training job {train_id} FAILED {ended_s:.1f} s after the kill of pid {victim} on n2")


HANG_TIMEOUT_S = 15  # cluster.rdzv_timeout_s for the hang test
# After the timeout: the rank on n1 reads the heartbeats, records the reason and exits;
# srun --kill-on-bad-exit then ends n2's task (the stopped process included). About 5 s here.
HANG_MARGIN_S = 30


def test_a_rank_that_hangs_on_n2_fails_the_job_within_the_timeout_and_is_named(two_node_cluster, tmp_path):
    """SIGSTOP the rank on n2 mid-run (it neither dies nor answers): the rank on n1 times out in
    its next collective after ``cluster.rdzv_timeout_s``, names rank 1 on n2 from the heartbeats
    (exit 76 in train_exit.json), the job is FAILED within the timeout plus a margin, nothing of
    it is left on either node, and the consolidation is CANCELLED."""
    env = two_node_cluster.env
    run_dir = tmp_path / "hanging run"
    run_cli(run_dir, *TWO_NODES, "train.max_steps=20000", "checkpoint.every_steps=0",
            f"cluster.rdzv_timeout_s={HANG_TIMEOUT_S}", env=env)
    ids = jobs(run_dir)
    train_id, cons_id = ids["train"], ids["consolidate"]
    with su.cancelled_on_exit(ids.values(), env=env):  # a failure leaves no ranks spinning
        victim = _rank1_on_n2(run_dir, train_id, env, min_steps=5)
        os.kill(victim, signal.SIGSTOP)
        t_stop = time.monotonic()
        rec = su.wait_for_job(train_id, timeout_s=HANG_TIMEOUT_S + 90, env=env)
        ended_s = time.monotonic() - t_stop
        assert rec["JobState"] == "FAILED", (rec, all_logs(run_dir))
        assert ended_s < HANG_TIMEOUT_S + HANG_MARGIN_S, f"job ended {ended_s:.0f} s after the stop\n{all_logs(run_dir)}"

        exit_rec = json.loads((run_dir / "train_exit.json").read_text())
        assert exit_rec["exit_code"] == 76, exit_rec
        assert f"rank 1 on n2 (pid {victim}) stopped answering" in exit_rec["reason"], exit_rec
        assert f"waited {HANG_TIMEOUT_S} s (cluster.rdzv_timeout_s)" in exit_rec["reason"]
        assert f"rank 1 on n2 (pid {victim}) stopped answering" in train_logs(run_dir, train_id)

        cons = su.wait_for_state(cons_id, {"CANCELLED"}, timeout_s=30, env=env)
        assert cons["Reason"] == "DependencyNeverSatisfied", cons
        deadline = time.monotonic() + 20
        while (left := _job_processes(train_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes of job {train_id} still alive: {left}"
        print(f"training job {train_id} FAILED {ended_s:.1f} s after SIGSTOP of pid {victim} on n2")
