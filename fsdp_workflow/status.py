"""Where a submitted run stands: its Slurm jobs, latest checkpoint, consolidated model, evaluations.

    python -m fsdp_workflow.status RUN_DIR
    python -m fsdp_workflow.status RUN_DIR --json

Jobs come from ``RUN_DIR/jobs.txt`` (written at submission). Their states come
from ``scontrol show job`` (answers without accounting, for MinJobAge after the
end), then ``sacct`` for jobs slurmctld has forgotten; when accounting is
disabled that is said, not hidden. Exit code 0, or 2 when RUN_DIR is not a run
directory.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.rundir import CONFIG_FILE, JOBS_FILE, RunDir
from fsdp_workflow.data.cache import CacheError
from fsdp_workflow.data.open import open_cache

# Slurm job state -> what the user is told.
_STATES = {
    "PENDING": "queued", "CONFIGURING": "queued", "RESV_DEL_HOLD": "queued", "REQUEUE_FED": "requeued",
    "REQUEUED": "requeued", "REQUEUE_HOLD": "requeued",
    "RUNNING": "running", "COMPLETING": "running", "STAGE_OUT": "running", "SIGNALING": "running",
    "SUSPENDED": "running", "RESIZING": "running", "STOPPED": "running",
    "COMPLETED": "done",
    "CANCELLED": "cancelled", "REVOKED": "cancelled",
    "FAILED": "failed", "TIMEOUT": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed", "DEADLINE": "failed", "PREEMPTED": "failed", "SPECIAL_EXIT": "failed",
}
_FIELD_SPLIT = re.compile(r" (?=[A-Za-z][A-Za-z0-9_/:]*=)")


@dataclass
class JobStatus:
    role: str  # train, consolidate, eval-step-N
    job_id: str
    status: str  # queued, running, requeued, done, failed, cancelled, unknown
    slurm_state: str = ""
    reason: str = ""  # Slurm's reason (Dependency, BeginTime, DependencyNeverSatisfied, ...)
    exit_code: str = ""
    restarts: int = 0
    source: str = ""  # scontrol, sacct, or why neither answered
    log: Optional[str] = None


@dataclass
class RunStatus:
    run_dir: str
    jobs: List[JobStatus] = field(default_factory=list)
    latest_checkpoint_step: Optional[int] = None
    checkpoint_steps: List[int] = field(default_factory=list)
    requeue_marker: bool = False
    consolidated_dir: str = ""
    consolidated: str = "absent"  # absent, present, verified, verification failed
    verification: Optional[dict] = None
    last_eval: Optional[dict] = None
    data: Optional[dict] = None  # the prepared token cache: path, samples, tokens, trained tokens
    notes: List[str] = field(default_factory=list)


def _run(argv: List[str], timeout_s: float = 15) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as err:
        return subprocess.CompletedProcess(argv, 127, "", str(err))


def read_jobs(layout: RunDir) -> List[tuple]:
    """``(role, job id)`` pairs of RUN_DIR/jobs.txt, oldest first."""
    path = layout.jobs
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1]))
    return out


def classify(slurm_state: str, restarts: int, reason: str) -> str:
    """Our status word for a Slurm state; a pending job that ran before is ``requeued``."""
    state = slurm_state.split()[0].rstrip("+") if slurm_state else ""
    status = _STATES.get(state, "unknown")
    if status == "queued" and restarts > 0:
        return "requeued"
    return status


def _from_scontrol(job_id: str) -> Optional[Dict[str, str]]:
    proc = _run(["scontrol", "-o", "show", "job", job_id])
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    rec: Dict[str, str] = {}
    for token in _FIELD_SPLIT.split(proc.stdout.splitlines()[0].strip()):
        key, sep, value = token.partition("=")
        if sep:
            rec[key] = value
    return rec


def _from_sacct(job_id: str) -> tuple:
    """(record or None, note). sacct may be disabled: the note says so."""
    proc = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,Reason,Restarts"])
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        if "disabled" in msg.lower():
            return None, "sacct: job accounting is disabled on this cluster"
        return None, f"sacct failed: {msg}" if msg else "sacct unavailable"
    for line in proc.stdout.splitlines():
        cols = line.split("|")
        if len(cols) >= 2 and cols[0] == job_id:
            cols += [""] * (5 - len(cols))
            return {"JobState": cols[1], "ExitCode": cols[2], "Reason": cols[3],
                    "Restarts": cols[4] or "0"}, ""
    return None, "unknown to sacct"


def _log_for(layout: RunDir, role: str, job_id: str) -> Optional[str]:
    log = layout.log_file(role, job_id)
    return str(log) if log.exists() else None


def job_status(layout: RunDir, role: str, job_id: str) -> JobStatus:
    rec, source = _from_scontrol(job_id), "scontrol"
    if rec is None:
        rec, note = _from_sacct(job_id)
        source = "sacct" if rec is not None else f"slurmctld no longer knows the job; {note}"
    st = JobStatus(role=role, job_id=job_id, status="unknown", source=source, log=_log_for(layout, role, job_id))
    if rec is not None:
        st.slurm_state = rec.get("JobState", "")
        st.reason = rec.get("Reason", "") if rec.get("Reason") not in ("None", "(null)") else ""
        st.exit_code = rec.get("ExitCode", "")
        try:
            st.restarts = int(rec.get("Restarts", "0") or 0)
        except ValueError:
            st.restarts = 0
        st.status = classify(st.slurm_state, st.restarts, st.reason)
    return st


def _data_summary(layout: RunDir) -> Optional[dict]:
    """What the prepare step left: the cache this run trains on and its counts (None before it ran)."""
    if not layout.data_pointer.exists():
        return None
    try:
        cache = open_cache(layout, pad_id=0)  # reads the pointer and meta.json; maps no array yet
    except CacheError as err:
        return {"cache": None, "note": str(err)}
    if cache is None:
        return {"cache": None, "note": "synthetic data: nothing prepared"}
    out: dict = {"cache": str(cache.path)}
    splits = cache.meta.get("splits") if isinstance(cache.meta.get("splits"), dict) else {}
    for split in ("train", "eval"):
        counts = splits.get(split)
        if isinstance(counts, dict):
            out[split] = {k: counts.get(k) for k in ("samples", "tokens", "trained_tokens")}
    return out


def collect(run_dir: Path) -> RunStatus:
    """Everything :func:`main` prints, as data."""
    layout = RunDir.recorded(run_dir)  # cluster.log_dir and consolidate.output_dir as the run recorded them
    rs = RunStatus(run_dir=str(layout.root))
    for role, job_id in read_jobs(layout):
        rs.jobs.append(job_status(layout, role, job_id))
    if not rs.jobs:
        rs.notes.append(f"no {JOBS_FILE}: nothing was submitted from this run directory yet")
    # complete checkpoints only, by the trainer's own rule (a step-N without .metadata is not one)
    rs.checkpoint_steps = [step for step, _ in layout.list_checkpoints()]
    rs.latest_checkpoint_step = rs.checkpoint_steps[-1] if rs.checkpoint_steps else None
    rs.requeue_marker = layout.requeue_marker.exists()
    rs.data = _data_summary(layout)
    out = layout.hf_model
    rs.consolidated_dir = str(out)
    if out.is_dir():
        rs.consolidated = "present"
        vpath = out / "verification.json"
        if vpath.is_file():
            try:
                rs.verification = json.loads(vpath.read_text())
                rs.consolidated = "verified" if rs.verification.get("ok") else "verification failed"
            except ValueError:
                rs.consolidated = "present (unreadable verification.json)"
    if layout.evals_file.is_file():
        lines = [l for l in layout.evals_file.read_text().splitlines() if l.strip()]
        if lines:
            try:
                rs.last_eval = json.loads(lines[-1])
            except ValueError:
                pass
    return rs


def format_text(rs: RunStatus) -> str:
    lines = [f"run: {rs.run_dir}"]
    for j in rs.jobs:
        extra = [f"slurm {j.slurm_state}" if j.slurm_state else "", f"reason {j.reason}" if j.reason else "",
                 f"exit {j.exit_code}" if j.exit_code and j.status in ("done", "failed", "cancelled") else "",
                 f"restarts {j.restarts}" if j.restarts else ""]
        detail = ", ".join(x for x in extra if x) or j.source
        lines.append(f"  {j.role:<12} {j.job_id:>8}  {j.status:<10} ({detail})")
        if j.log:
            lines.append(f"  {'':<12} {'':>8}  log: {j.log}")
    step = rs.latest_checkpoint_step
    lines.append(f"latest checkpoint: {'step ' + str(step) if step is not None else 'none yet'}"
                 + ("  (.requeue marker present: stopped on a signal)" if rs.requeue_marker else ""))
    if rs.data is not None:
        train = rs.data.get("train") or {}
        counts = (f"{train.get('samples')} samples, {train.get('tokens')} tokens, {train.get('trained_tokens')} trained"
                  if train else rs.data.get("note", ""))
        lines.append(f"data: {counts}" + (f" ({rs.data['cache']})" if rs.data.get("cache") else ""))
    lines.append(f"consolidated model: {rs.consolidated} ({rs.consolidated_dir})")
    if rs.last_eval:
        lines.append("last evaluation: " + ", ".join(f"{k}={v}" for k, v in rs.last_eval.items()))
    lines += [f"note: {n}" for n in rs.notes]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdp_workflow.status", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="the run directory given as run_dir= at submission")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir).absolute()
    if not (run_dir / CONFIG_FILE).is_file():
        print(f"fsdp_workflow.status: {run_dir} is not a run directory (no {CONFIG_FILE}); pass the "
              "run_dir= given to `python -m fsdp_workflow`.", file=sys.stderr)
        return EXIT_USAGE
    rs = collect(run_dir)
    print(json.dumps(asdict(rs), indent=2) if args.json else format_text(rs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
