"""``python -m fsdp_workflow.status``: against real Slurm jobs (held, then cancelled), and on real files.

The Slurm tests hold their jobs and cancel them (no training). The others need
no cluster: checkpoints are real DCP saves, damaged the way a full disk or a bad
copy damages them; the trainer's ``train_exit.json`` and a training log that
slurmctld no longer knows are written as the trainer and train.sbatch write them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline_helpers as ph
import slurm_utils as su
from fsdp_workflow import status as status_mod
from fsdp_workflow.core.exit_codes import EXIT_DISK_FULL, EXIT_PEER_TIMEOUT, MEANINGS

pytestmark = [pytest.mark.timeout(120)]


def _status(run_dir, *args):
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _dcp_save(path: Path, scale: float = 1.0) -> None:
    """A real single-process DCP checkpoint (``.metadata`` + ``__0_0.distcp``) in ``path``."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended
        dcp.save({"model.w": torch.arange(2048, dtype=torch.float32) * scale, "model.b": torch.ones(16)},
                 checkpoint_id=str(path))


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory):
    """A planned, never-submitted run directory (config.yaml and scripts), shared by the file tests."""
    run_dir = tmp_path_factory.mktemp("status") / "planned"
    proc = ph.run_cli(run_dir, "dry_run=true", "data=synthetic")
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.mark.slurm
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

    _dcp_save(run_dir / "checkpoints" / "step-10")  # complete: DCP wrote .metadata last
    (run_dir / "checkpoints" / "step-15").mkdir()  # no .metadata: not a checkpoint, by the trainer's own rule
    (run_dir / "checkpoints" / "step-20.tmp").mkdir()
    su.scancel(ids["train"])
    su.wait_for_job(ids["consolidate"], timeout_s=60)
    text = _status(run_dir)
    assert f"train        {ids['train']:>8}  cancelled" in text
    assert "DependencyNeverSatisfied" in text
    assert "latest checkpoint: step 10" in text and "resume will skip" not in text


def test_status_names_checkpoints_resume_skips_and_those_set_aside(planned_run):
    """Real DCP saves: a truncated shard and a garbled .metadata are complete by name but fail the
    health check; status says resume skips them and why, and the newest resumable one is older."""
    ckpts = planned_run / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        _dcp_save(ckpts / f"step-{step}", scale=step)
    shard = ckpts / "step-8" / "__0_0.distcp"
    with open(shard, "r+b") as f:  # a save cut short by a full disk: the shard lost its tail
        f.truncate(shard.stat().st_size // 2)
    (ckpts / "step-10" / ".metadata").write_bytes(b"\x80\x04garbled")
    (ckpts / "step-6").rename(ckpts / "step-6.corrupt")  # what resume does to one that failed

    st = status_mod.collect(planned_run)
    assert st.latest_checkpoint_step == 4 and st.checkpoint_steps == [2, 4]
    assert [(c["step"], c["path"]) for c in st.skipped_checkpoints] == [
        (8, str(ckpts / "step-8")), (10, str(ckpts / "step-10"))]
    assert "truncated" in st.skipped_checkpoints[0]["problem"] and str(shard) in st.skipped_checkpoints[0]["problem"]
    assert "cannot be parsed" in st.skipped_checkpoints[1]["problem"]
    assert st.quarantined == [str(ckpts / "step-6.corrupt")]

    text = _status(planned_run)
    assert "latest checkpoint: step 4" in text
    assert f"checkpoint step 8: resume will skip it: shard {shard} is truncated" in text, text
    assert "checkpoint step 10: resume will skip it: " in text, text
    assert f"set aside as corrupt: {ckpts / 'step-6.corrupt'}" in text, text


@pytest.mark.parametrize("code", [EXIT_DISK_FULL, EXIT_PEER_TIMEOUT])
def test_status_shows_the_trainers_exit_code_meaning_and_reason(planned_run, code):
    reason = {EXIT_DISK_FULL: f"disk full (ENOSPC) while saving {planned_run}/checkpoints/step-12.tmp",
              EXIT_PEER_TIMEOUT: "rank 1 on n2 stopped answering: all_reduce timed out after 45 s"}[code]
    (planned_run / "train_exit.json").write_text(json.dumps(
        {"exit_code": code, "reason": reason, "step": 12, "checkpoint": None}))
    try:
        text = _status(planned_run)
        st = json.loads(_status(planned_run, "--json"))
    finally:
        (planned_run / "train_exit.json").unlink()
    assert f"trainer exit: {code} ({MEANINGS[code]}): {reason} at step 12" in text, text
    assert (st["train_exit"]["exit_code"], st["train_exit"]["meaning"], st["train_exit"]["reason"]) == (
        code, MEANINGS[code], reason)


@pytest.mark.slurm
def test_status_counts_requeues_from_the_log_when_slurm_forgot_the_job(slurm_cluster, tmp_path):
    """No scontrol record (the id is unknown to the cluster): the count and the limit come from
    train.sbatch's "restart K/MAX" lines, with its out-of-requeues message."""
    run_dir = tmp_path / "forgotten"
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "cluster.max_requeues=1").returncode == 0
    job = 999999901
    (run_dir / "jobs.txt").write_text(f"train {job}\n")
    (run_dir / "logs").mkdir(exist_ok=True)
    refusal = (f"[fsdp_workflow] train job {job} restart 2/1: requeued more often than cluster.max_requeues=1 "
               "allows (by Slurm: preemption, node failure or scontrol requeue); failing before training starts.")
    (run_dir / "logs" / f"train-{job}.out").write_text(
        f"[fsdp_workflow] train job {job} restart 0/1 nodes n1 master n1:20001\nstep 1: loss 9.0\n"
        f"[fsdp_workflow] train job {job} restart 1/1 nodes n1 master n1:20001\nstep 2: loss 8.0\n"
        f"{refusal}\n")
    st = json.loads(_status(run_dir, "--json"))
    train = st["jobs"][0]
    assert (train["restarts"], train["max_requeues"], train["message"]) == (2, 1, refusal), train
    text = _status(run_dir)
    assert "restarts 2 (cluster.max_requeues=1)" in text and refusal in text, text


def test_status_of_a_run_dir_never_submitted(tmp_path):
    run_dir = tmp_path / "plan"
    assert ph.run_cli(run_dir, "dry_run=true").returncode == 0
    assert "nothing was submitted" in _status(run_dir)
    bad = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


@pytest.mark.slurm
def test_status_shows_the_time_left_in_the_running_training_jobs_allocation(slurm_cluster, tmp_path):
    """A real running job with --time=10 stands in for the training job (no training: metrics.jsonl is
    written as the trainer writes it): the time left is scontrol's TimeLimit minus RunTime, and the
    ETA at 2 s a step for the 90 steps left (3 minutes) fits in it."""
    from fsdp_workflow.config import compose
    from fsdp_workflow.config.load import to_yaml

    run_dir = tmp_path / "running"
    (run_dir / "logs").mkdir(parents=True)
    # status reads config.yaml through the run record: a whole config, as planning writes it
    (run_dir / "config.yaml").write_text(to_yaml(compose(["+experiment=smoke", "train.max_steps=100",
                                                          f"run_dir={run_dir}"])))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"time": 1000.0 + 2 * s, "step": s, "loss": 5.0 - s / 10, "tokens_per_s": 900.0, "mfu": 0.1}) + "\n"
        for s in range(1, 11)))
    job = su.sbatch("--time=10", "--mem=100M", "-c", "1", "-o", str(run_dir / "logs" / "train-%j.out"),
                    "--wrap", "sleep 600")
    try:
        (run_dir / "jobs.txt").write_text(f"train {job}\n")
        su.wait_for_state(job, ["RUNNING"], timeout_s=120)
        st = json.loads(_status(run_dir, "--json"))
        p = st["progress"]
        assert (p["train_job"], p["time_limit_s"], p["eta_s"], p["requeues"]) == (str(job), 600.0, 180.0, 0)
        assert 0 < p["time_left_s"] <= 600
        text = _status(run_dir)
        assert "progress: step 10 of 100 (10%), 2 s/step (median of the last 20), ETA 3m00s" in text
        line = next(l for l in text.splitlines() if l.startswith("slurm time left: "))
        assert line.endswith(f" of 10m00s (train job {job})") and "outlasts" not in line, line
        assert "requeues: 0" in text and "loss (step 10: 4.0000)" in text
    finally:
        su.scancel(job)

