"""One live chain per run directory, a finished run not run again, the config that runs is the one validated.

On the real local Slurm. The live chain is kept pending (``begin=now+600``) so nothing
trains; the finished run is a run directory whose last checkpoint and model exist.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su
from tests.launch.test_complete_inputs import save_step

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

LATER = "+cluster.additional_parameters.begin=now+600"  # the chain waits in the queue: nothing runs


def _submit_sh(run_dir, env=None):
    return subprocess.run(["bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60, env=env)


def test_the_same_command_twice_refuses_while_the_chain_is_queued(slurm_cluster, tmp_path):
    run_dir = tmp_path / "live chain"
    args = ("data=synthetic", "name=live1", LATER)
    first = ph.run_cli(run_dir, *args)
    assert first.returncode == 0, first.stderr
    ids = ph.jobs(run_dir)
    jobs_txt = (run_dir / "jobs.txt").read_text()
    try:
        again = ph.run_cli(run_dir, *args)  # the very same command
        assert again.returncode == 2, again.stdout + again.stderr
        assert "still in the queue" in again.stderr
        assert f"train job {ids['train']}: PENDING (BeginTime)" in again.stderr
        assert f"scancel {ids['train']} {ids['consolidate']}" in again.stderr
        assert "python -m fsdp_workflow.status" in again.stderr and "Traceback" not in again.stderr
        by_sh = _submit_sh(run_dir)  # submit.sh asks the same question
        assert by_sh.returncode == 2, by_sh.stdout + by_sh.stderr
        assert f"job {ids['train']}: PENDING (BeginTime)" in by_sh.stderr and "scancel" in by_sh.stderr
        assert (run_dir / "jobs.txt").read_text() == jobs_txt  # no second chain
        assert su._run(["squeue", "-h", "-n", "live1-train", "-o", "%i"]).stdout.split() == [str(ids["train"])]
    finally:
        ph.cancel_unfinished(ids)
    for job in ids.values():
        su.wait_for_job(job, timeout_s=60)
    # once the chain has ended, submitting again is allowed (here: still before any step, so it submits)
    third = _submit_sh(run_dir)
    assert third.returncode == 0, third.stderr
    ph.cancel_unfinished(ph.jobs(run_dir))


def _finished(run_dir, step):
    save_step(run_dir / "checkpoints" / f"step-{step}")  # whole: "complete" checks it as resume does
    (run_dir / "hf_model").mkdir()


def test_a_finished_run_says_complete_and_submits_nothing(slurm_cluster, tmp_path):
    run_dir = tmp_path / "done run"
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "name=done1").returncode == 0
    _finished(run_dir, 30)  # train.max_steps=30 reached, model written
    by_sh = _submit_sh(run_dir)
    assert by_sh.returncode == 0, by_sh.stderr
    assert "this run is complete" in by_sh.stdout and str(run_dir / "hf_model") in by_sh.stdout
    cli = ph.run_cli(run_dir, "data=synthetic", "name=done1")
    assert cli.returncode == 0, cli.stderr
    assert "this run is complete" in cli.stdout and str(run_dir / "hf_model") in cli.stdout
    assert not (run_dir / "jobs.txt").exists()
    assert su._run(["squeue", "-h", "-n", "done1-train", "-o", "%i"]).stdout.split() == []

    # Continuing is a choice; the old model is moved aside first, never a chain that fails on it.
    more = ph.run_cli(run_dir, "data=synthetic", "name=done1", "train.max_steps=60",
                      f"checkpoint.resume={run_dir / 'checkpoints' / 'step-30'}")
    assert more.returncode == 2, more.stdout + more.stderr
    assert "Move it aside first: mv" in more.stderr and "hf_model.step-30" in more.stderr
    assert not (run_dir / "jobs.txt").exists()
    by_sh = _submit_sh(run_dir)  # the scripts of that plan say the same
    assert by_sh.returncode == 2 and "Move it aside first" in by_sh.stderr, by_sh.stdout + by_sh.stderr


def test_submit_sh_does_not_call_a_run_with_a_damaged_final_checkpoint_complete(slurm_cluster, tmp_path):
    """submit.sh asks resume's question (chain_guard), as the CLI does: a truncated shard is not complete."""
    run_dir = tmp_path / "damaged run"
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "name=damaged1", LATER).returncode == 0
    _finished(run_dir, 30)
    shard = next((run_dir / "checkpoints" / "step-30").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)  # a copy cut short: .metadata is intact
    by_sh = _submit_sh(run_dir)
    ids = ph.jobs(run_dir) if (run_dir / "jobs.txt").exists() else {}
    try:
        assert by_sh.returncode == 0, by_sh.stdout + by_sh.stderr
        assert "complete" not in by_sh.stdout, by_sh.stdout  # was: "this run is complete", the model kept
        assert f"checkpoint {run_dir / 'checkpoints' / 'step-30'} cannot be resumed" in by_sh.stderr, by_sh.stderr
        assert "is truncated" in by_sh.stderr and "trains its steps again" in by_sh.stderr, by_sh.stderr
        assert set(ids) == {"train", "consolidate"}  # the chain that trains the lost steps again
    finally:
        ph.cancel_unfinished(ids)


def test_an_edited_config_stops_the_job_that_reads_it(slurm_cluster, tmp_path):
    run_dir = tmp_path / "edited"
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "name=edited1").returncode == 0
    prov = json.loads((run_dir / "provenance.json").read_text())
    cfg = run_dir / "config.yaml"
    assert prov["config_sha256"] == __import__("hashlib").sha256(cfg.read_bytes()).hexdigest()
    cfg.write_text(cfg.read_text().replace("max_steps: 30", "max_stepz: 30"))  # a hand edit, never validated
    sub = _submit_sh(run_dir)
    assert sub.returncode == 0, sub.stderr
    ids = ph.jobs(run_dir)
    try:
        train = su.wait_for_job(ids["train"], timeout_s=120)
        assert (train["JobState"], train["ExitCode"]) == ("FAILED", "2:0"), (train, ph.logs(run_dir))
        cons = su.wait_for_job(ids["consolidate"], timeout_s=60)
        assert cons["JobState"] == "CANCELLED"
    finally:
        ph.cancel_unfinished(ids)
    log = ph.logs(run_dir)
    assert "config.yaml changed since planning" in log and "python -m fsdp_workflow.replan" in log
    assert not (run_dir / "metrics.jsonl").exists()  # nothing ran
    record = json.loads((run_dir / "job_exits" / f"train-{ids['train']}.json").read_text())
    assert (record["exit_code"], record["cause"]) == (2, "config_changed")
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)],
                        capture_output=True, text=True, timeout=60).stdout
    assert "why: exit 2: config.yaml changed since planning" in st, st
    assert "warning: config.yaml changed since planning" in st and "fsdp_workflow.replan" in st


@pytest.mark.slow  # a whole chain: its module is handed out with the long groups (tests/conftest.py)
def test_replan_validates_an_edited_config_and_records_it(slurm_cluster, tmp_path):
    """The way out the refusal names: a typo is refused with its key; a valid edit is recorded and runs."""
    run_dir = tmp_path / "replan"
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "name=replan1",
                      "consolidate.enabled=false").returncode == 0
    cfg = run_dir / "config.yaml"
    planned = cfg.read_text()
    old_hash = json.loads((run_dir / "provenance.json").read_text())["config_sha256"]
    replan = [sys.executable, "-m", "fsdp_workflow.replan", str(run_dir)]
    cfg.write_text(planned.replace("max_steps: 30", "max_stepz: 30"))
    typo = subprocess.run(replan, capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "max_stepz" in typo.stderr and "nothing changed" in typo.stderr, typo.stderr
    assert json.loads((run_dir / "provenance.json").read_text())["config_sha256"] == old_hash
    cfg.write_text(planned.replace("max_steps: 30", "max_steps: 20"))
    ok = subprocess.run(replan, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["replanned_from"]["config_sha256"] == old_hash and prov["config_sha256"] != old_hash
    assert "max_steps: 20" in cfg.read_text()
    sub = _submit_sh(run_dir)
    assert sub.returncode == 0, sub.stderr
    ids = ph.jobs(run_dir)
    try:
        train = su.wait_for_job(ids["train"], timeout_s=180)
        assert train["JobState"] == "COMPLETED", (train, ph.logs(run_dir))
    finally:
        ph.cancel_unfinished(ids)
    assert ph.metrics(run_dir)[-1]["step"] == 20  # the edited, validated config ran
