"""Shared by the Slurm pipeline tests: submit the smoke chain, wait for it, read the run dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import slurm_utils as su

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["cluster=slurm", "cluster.partition=debug"]


def run_cli(run_dir: Path, *overrides: str, experiment: str = "smoke", timeout_s: float = 120,
            cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m fsdp_workflow +experiment=smoke cluster=slurm ...``, from the repo root unless ``cwd``."""
    argv = [sys.executable, "-m", "fsdp_workflow", f"+experiment={experiment}", *SMOKE, f"run_dir={run_dir}",
            *overrides]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)


def jobs(run_dir: Path) -> Dict[str, int]:
    """role -> job id, from RUN_DIR/jobs.txt."""
    out = {}
    for line in (run_dir / "jobs.txt").read_text().splitlines():
        role, job_id = line.split()[:2]
        out[role] = int(job_id)
    return out


def metrics(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def logs(run_dir: Path, tail_chars: int = 4000) -> str:
    """Every job log of the run (the last ``tail_chars`` of each; 0: all)."""
    parts = []
    for p in sorted((run_dir / "logs").rglob("*.out")) + sorted((run_dir / "logs").rglob("*.err")):
        text = p.read_text(errors="replace")
        parts.append(f"--- {p}\n{text[-tail_chars:] if tail_chars else text}")
    return "\n".join(parts)


def assert_batch_scripts_recorded(run_dir: Path, ids: Dict[str, int]) -> None:
    """Every job's batch script, as Slurm holds it, is byte for byte the one in the run directory."""
    for role, job_id in ids.items():
        script = run_dir / ("eval.sbatch" if role.startswith("eval-") else f"{role}.sbatch")
        held = su._run(["scontrol", "write", "batch_script", str(job_id), "-"])
        assert held.returncode == 0, held.stderr
        assert held.stdout == script.read_text(), f"job {job_id} ({role}) ran a script that is not {script}"


def wait_done(run_dir: Path, job_id: int, timeout_s: float) -> dict:
    rec = su.wait_for_job(job_id, timeout_s=timeout_s)
    return rec


def load_consolidated(model_dir: Path) -> None:
    """The consolidated output loads with transformers and produces finite logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()
    verification = json.loads((model_dir / "verification.json").read_text())
    assert verification.get("ok") is True, verification


def env_with(**extra: str) -> dict:
    return {**os.environ, **extra}


def wait_batch_gone(job_id: int, nodes: List[str], timeout_s: float = 60) -> None:
    """Wait until the previous run's batch script has exited on every node.

    A job that requeues itself (``scontrol requeue`` in its batch script) is
    PENDING before that script has finished; releasing it at once (tests only:
    StartTime=now) can start the next run while slurmd is still cleaning up the
    old one (seen here: "Killing non-startable batch JobId=N: Job credential
    revoked"). slurmd removes ``job<ID>/`` from its spool dir
    when the batch step is gone.
    """
    import time

    conf = su._run(["scontrol", "show", "config"]).stdout
    spool = next(l.split("=", 1)[1].strip() for l in conf.splitlines() if l.startswith("SlurmdSpoolDir"))
    dirs = [Path(spool.replace("%n", n)) / f"job{job_id:05d}" for n in nodes]
    deadline = time.monotonic() + timeout_s
    while any(d.exists() for d in dirs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: batch script still present after {timeout_s} s: {dirs}")
        time.sleep(0.2)
    # slurmd revokes the old run's credential with 1-second resolution; a relaunch in
    # the same second is refused ("Job credential revoked") and the job FAILS.
    time.sleep(2.5)


def wait_for_log_text(run_dir: Path, job_id: int, text: str, timeout_s: float = 120, count: int = 1) -> str:
    """Wait until ``text`` appears ``count`` times in the job's log while the job still runs; return the log.

    Fails at once (with every log of the run) if the job ends or leaves PENDING/RUNNING first.
    """
    import time

    log_path = run_dir / "logs" / f"train-{job_id}.out"
    deadline = time.monotonic() + timeout_s
    while True:
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        if log.count(text) >= count:
            return log
        state = su.job_state(job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} is {state}\n{logs(run_dir)}"
        assert time.monotonic() < deadline, f"{text!r} not seen {count}x in {timeout_s} s\n{logs(run_dir)}"
        time.sleep(0.3)


def release_after_requeue(job_id: int, nodes: List[str], timeout_s: float = 120) -> dict:
    """A job that was requeued (by itself or ``scontrol requeue``): wait until it is PENDING and
    its old batch script is gone from every node, then make it eligible now. Returns its record."""
    su.wait_for_state(job_id, {"PENDING"}, timeout_s=timeout_s)
    wait_batch_gone(job_id, nodes)
    return su.release_requeued(job_id, timeout_s=timeout_s)


def cancel_unfinished(ids: Dict[str, int]) -> None:
    """Cleanup: cancel every job of the run that has not ended (a failed assertion must not leave
    a training job holding the test cluster's CPUs)."""
    for job_id in ids.values():
        rec = su.show_job(job_id)
        if rec is not None and rec.get("JobState") not in su.TERMINAL_STATES:
            su._run(["scancel", str(job_id)], check=False)
