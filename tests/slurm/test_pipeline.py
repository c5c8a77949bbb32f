"""The whole chain on the real local Slurm: prepare, train afterok, consolidate afterok (the CLI or submit.sh).

Each test runs the smoke experiment (tiny Llama, 1 node x torchrun with 2 CPU
ranks, fits 2 CPUs and 8 GB) with the real trainer and consolidator.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]
EVAL_RECORD_KEYS = {"step", "status", "job_id", "seconds", "loss", "perplexity", "num_tokens", "ema_loss",
                    "ema_perplexity"}


def _assert_chain_completed(run_dir, ids):
    prep = su.wait_for_job(ids["prepare"], timeout_s=120)
    assert prep["JobState"] == "COMPLETED", (prep, ph.logs(run_dir))
    train = su.wait_for_job(ids["train"], timeout_s=180)
    assert train["StartTime"] >= prep["EndTime"]
    assert train["JobState"] == "COMPLETED", (train, ph.logs(run_dir))
    cons = su.wait_for_job(ids["consolidate"], timeout_s=120)
    assert cons["JobState"] == "COMPLETED", (cons, ph.logs(run_dir))
    assert cons["StartTime"] >= train["EndTime"]
    ph.load_consolidated(run_dir / "hf_model")


def test_cli_submits_chain_that_trains_consolidates_and_loads(slurm_cluster, tmp_path):
    """The CLI route, with an evaluation job per checkpoint (consolidate.every_checkpoint) and an EMA riding along.

    With train.ema_decay the consolidation job writes hf_model_ema/ too, and each
    evaluation reports the EMA's loss beside the model's.

    The chain runs the code that was submitted, not the checkout as it is when the jobs
    start: a copy of the package plans it (``PYTHONPATH=<copy>``, as a user's checkout
    would), the training job is held, the copy is broken (its trainer's loop module
    deleted, as a branch switch or an edit in progress would), the job is released, and
    the whole chain, evaluation jobs included, completes from ``RUN_DIR/code``.

    (A signalled run that requeues, resumes and is then consolidated is proved on the
    two-node cluster, tests/multinode/test_requeue_node.py, and the single-node requeue
    route in tests/slurm/test_requeue_faults.py.)
    """
    checkout = tmp_path / "checkout"
    shutil.copytree(ph.ROOT / "fsdp_workflow", checkout / "fsdp_workflow",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run_dir = tmp_path / "run cli"
    proc = ph.run_cli(run_dir, "consolidate.every_checkpoint=true", "checkpoint.every_steps=15", "train.ema_decay=0.9",
                      cwd=tmp_path, env=ph.env_with(PYTHONPATH=str(checkout)))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    ids = ph.jobs(run_dir)
    try:
        su._run(["scontrol", "hold", str(ids["train"])])
        # It printed both ids, the logs and how to follow them, and did not wait.
        assert f"data preparation job: {ids['prepare']}" in proc.stdout
        assert f"training job:      {ids['train']}" in proc.stdout
        assert f"consolidation job: {ids['consolidate']}" in proc.stdout
        assert "python -m fsdp_workflow.status" in proc.stdout and "tail -f" in proc.stdout
        rec = su.show_job(ids["consolidate"])
        assert rec["JobState"] == "PENDING" and f"afterok:{ids['train']}" in rec["Dependency"]
        ph.assert_batch_scripts_recorded(run_dir, ids)  # what a user reads is what ran
        snap = json.loads((run_dir / "provenance.json").read_text())["code_snapshot"]
        assert snap["source"] == str(checkout / "fsdp_workflow") and snap["path"] == str(run_dir / "code" / "fsdp_workflow")
        assert (run_dir / "code" / "fsdp_workflow" / "train" / "loop.py").is_file()
        assert not list((run_dir / "code").rglob("__pycache__"))
        (checkout / "fsdp_workflow" / "train" / "loop.py").unlink()  # the checkout no longer trains
        su._run(["scontrol", "release", str(ids["train"])])
        _assert_chain_completed(run_dir, ids)
    finally:
        ph.cancel_unfinished(ids)
    train_log = (run_dir / "logs" / f"train-{ids['train']}.out").read_text()
    assert f"code: {run_dir / 'code' / 'fsdp_workflow'}" in train_log, train_log
    ph.load_consolidated(run_dir / "hf_model_ema")  # written by the same job, before hf_model/
    assert ph.metrics(run_dir)[-1]["step"] == 30

    # One evaluation job per committed checkpoint, submitted by the trainer's post-checkpoint hook.
    evals = {role: job for role, job in ph.jobs(run_dir).items() if role.startswith("eval-step-")}
    assert set(evals) == {"eval-step-15", "eval-step-30"}, ph.jobs(run_dir)
    ph.assert_batch_scripts_recorded(run_dir, evals)
    for job in evals.values():
        rec = su.wait_for_job(job, timeout_s=180)
        assert rec["JobState"] == "COMPLETED", (rec, ph.logs(run_dir))
    records = sorted((json.loads(l) for l in (run_dir / "evals.jsonl").read_text().splitlines()),
                     key=lambda r: r["step"])
    assert [(r["step"], r["status"]) for r in records] == [(15, "ok"), (30, "ok")], records
    assert all(1.0 < r["perplexity"] < 1e6 and 1.0 < r["ema_perplexity"] < 1e6 for r in records)
    assert all(r["ema_loss"] != r["loss"] for r in records)
    # Each line is the evaluation job's own, whole record (docs/evaluation.md#evalsjsonl).
    assert all(set(r) == EVAL_RECORD_KEYS and r["seconds"] > 0 for r in records), records
    assert {r["step"]: r["job_id"] for r in records} == {15: str(evals["eval-step-15"]), 30: str(evals["eval-step-30"])}
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"]))
               and r["ema_perplexity"] == pytest.approx(math.exp(r["ema_loss"])) for r in records)
    assert records[0]["num_tokens"] == records[1]["num_tokens"] > 0  # the same held-out tokens at every step
    assert not any((run_dir / "evals" / "pending").iterdir())

    status = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir), "--json"],
                            capture_output=True, text=True, check=True)
    st = json.loads(status.stdout)
    assert [(j["role"], j["status"]) for j in st["jobs"] if not j["role"].startswith("eval-")] == [
        ("prepare", "done"), ("train", "done"), ("consolidate", "done")]
    assert st["latest_checkpoint_step"] == 30 and st["consolidated"] == "verified"
    assert st["consolidated_ema"] == "verified" and st["consolidated_ema_dir"] == str(run_dir / "hf_model_ema")
    # finished: no time left is shown (an ETA is only for a running job), and the chain is done
    assert (st["progress"]["step"], st["progress"]["max_steps"], st["progress"]["eta_s"]) == (30, 30, None)
    assert st["chain"] == "done" and st["debris"] == []
    text = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], capture_output=True,
                          text=True, timeout=60).stdout
    assert f"code: snapshot {snap['sha256'][:12]} ({run_dir / 'code' / 'fsdp_workflow'})" in text, text
    card_dir = run_dir / "hf_model"  # the model card links the loss curve drawn beside it
    assert (card_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](loss_curve.png)" in (card_dir / "README.md").read_text()


def test_submit_sh_from_a_fresh_login_shell_runs_the_identical_chain(slurm_cluster, tmp_path):
    """``bash submit.sh`` under ``env -i``: the jobs run the interpreter and environment that planned.

    ``env -i`` leaves only ``PATH`` (the system's, where Slurm's commands are, and no venv) and
    ``SLURM_CONF``. Without the recorded interpreter the preparation job ran whichever
    ``python`` that PATH finds (here none; on a login node often one without the project's
    packages: ``ModuleNotFoundError``). The same chain proves ``cluster.log_dir`` (created at
    planning, used by every job and by status), the conversation smoke run (loss on assistant
    turns, chatml, documents packed apart), and that a consolidation's staging directory left
    by an earlier, killed run is removed by the next consolidation job (nothing left behind).
    """
    run_dir = tmp_path / "run sh"
    log_dir = tmp_path / "site logs"
    proc = ph.run_cli(run_dir, "dry_run=true", f"cluster.log_dir='{log_dir}'", experiment="smoke_chat")
    assert proc.returncode == 0, proc.stderr
    assert log_dir.is_dir()
    debris = run_dir / ".hf_model.tmp-4242"  # what a requeued or killed consolidation leaves
    (debris / "part").mkdir(parents=True)
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], capture_output=True, text=True)
    assert f"left behind: {debris}" in st.stdout, st.stdout
    fresh_shell = ["env", "-i", "PATH=/usr/bin:/bin", f"SLURM_CONF={slurm_cluster.slurm_conf}",
                   "bash", str(run_dir / "submit.sh")]
    out = subprocess.run(fresh_shell, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    ids = ph.jobs(run_dir)
    assert set(ids) == {"prepare", "train", "consolidate"}
    try:
        ph.assert_batch_scripts_recorded(run_dir, ids)
        _assert_chain_completed(run_dir, ids)
    finally:
        ph.cancel_unfinished(ids)
    assert (log_dir / f"train-{ids['train']}.out").exists() and not (run_dir / "logs").exists()
    assert not debris.exists()
    status = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir), "--json"],
                            capture_output=True, text=True, check=True)
    logs = [j["log"] for j in json.loads(status.stdout)["jobs"]]
    assert logs == [str(log_dir / f"{role}-{ids[role]}.out") for role in ("prepare", "train", "consolidate")]
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)], capture_output=True, text=True)
    assert "left behind" not in st.stdout, st.stdout
    # the same command again: complete, nothing submitted
    again = subprocess.run(fresh_shell, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "this run is complete" in again.stdout, again.stdout + again.stderr
    assert ph.jobs(run_dir) == ids


def test_bad_data_fails_the_prepare_job_and_nothing_trains(slurm_cluster, tmp_path):
    data = tmp_path / "chat.jsonl"
    lines = (ph.ROOT / "fsdp_workflow" / "assets" / "smoke" / "chat.jsonl").read_text().splitlines()
    bad = json.loads(lines[2])
    bad["messages"][-1]["role"] = "narrator"  # an unknown role: found only when the data is read
    data.write_text("\n".join(lines[:2] + [json.dumps(bad)] + lines[3:]) + "\n")
    run_dir = tmp_path / "run bad data"
    proc = ph.run_cli(run_dir, f"data.path={data}", experiment="smoke_chat")
    assert proc.returncode == 0, proc.stderr
    ids = ph.jobs(run_dir)
    prep = su.wait_for_job(ids["prepare"], timeout_s=120)
    assert prep["JobState"] == "FAILED", (prep, ph.logs(run_dir))
    assert f"{data}:3" in ph.logs(run_dir, tail_chars=0)  # file and line of the bad record
    for role in ("train", "consolidate"):
        rec = su.wait_for_job(ids[role], timeout_s=60)
        assert (rec["JobState"], rec["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), rec
    # status names the cause, not only the log path: the record's code and the log's file:line
    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir)],
                        capture_output=True, text=True, check=True).stdout
    assert f"why: exit 2: bad input at {data}:3" in st, st
    assert f"log says: {data}:3" in st and "fix: fix that line" in st
