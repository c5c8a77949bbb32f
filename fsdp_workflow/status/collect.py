"""Collect where a submitted run stands (``RunStatus``): its Slurm jobs, latest checkpoint, model, evaluations.

Jobs come from ``RUN_DIR/jobs.txt`` (written at submission). Their states come
from ``scontrol show job`` (answers without accounting, for MinJobAge after the
end), then ``sacct`` for jobs slurmctld has forgotten; when accounting is
disabled that is said, not hidden. A training job's restarts come from
``scontrol`` (``Restarts``), else from the ``restart k/M`` lines its batch script
logs. Also shown: the trainer's ``train_exit.json`` (code, meaning, reason), and
which checkpoints resume will use: complete ``step-N`` that fail the cheap
:func:`~fsdp_workflow.core.checkpoint_health.checkpoint_problem` check are named
with the reason resume will skip them, and ``step-N.corrupt`` ones set aside.

Nothing broken is skipped in silence: a record that cannot be read (``train_exit.json``,
``provenance.json``, ``config.yaml``, a line of ``metrics.jsonl`` or ``evals.jsonl``, a
heartbeat) is listed in ``problems`` with its file, its line and what is wrong. Whether
the run is alive comes from :mod:`.liveness`; a stopped run gets no ETA, and the commands
to resume or consolidate it (:mod:`.commands`, shell-quoted).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.curves import read_series
from fsdp_workflow.core.config_hash import PROVENANCE_KEY, changed_message, file_sha256
from fsdp_workflow.core.exit_codes import MEANINGS
from fsdp_workflow.core.job_exit import explain, read_record
from fsdp_workflow.core.reasons import explain as explain_reason
from fsdp_workflow.core.rundir import JOBS_FILE, RunDir
from fsdp_workflow.data.cache import CacheError
from fsdp_workflow.data.mixture import describe as describe_sources
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.status.commands import consolidate_argv, resume_argv, shell
from fsdp_workflow.status.eta import Progress, run_progress
from fsdp_workflow.status.liveness import local_liveness, read_heartbeats, slurm_liveness

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
# train.sbatch logs "[fsdp_workflow] train job N restart K/MAX ..." at every start (and when it refuses one).
_RESTART_LINE = re.compile(r"^\[fsdp_workflow\] .*\brestart (\d+)/(\d+)\b")
# What train.sbatch says when the requeues are spent (either route); shown as a note.
_OUT_OF_REQUEUES = "cluster.max_requeues="


@dataclass
class JobStatus:
    role: str  # train, consolidate, eval-step-N
    job_id: str
    status: str  # queued, running, requeued, done, failed, cancelled, unknown
    slurm_state: str = ""
    reason: str = ""  # Slurm's reason (Dependency, BeginTime, DependencyNeverSatisfied, ...)
    exit_code: str = ""
    restarts: int = 0  # times Slurm requeued it: scontrol's Restarts, else the log's "restart K/MAX" lines
    max_requeues: Optional[int] = None  # cluster.max_requeues, as the training job's log states it
    source: str = ""  # scontrol, sacct, or why neither answered
    log: Optional[str] = None
    message: str = ""  # the batch script's last word on requeueing ("out of requeues"), if any
    time_limit: str = ""  # scontrol's TimeLimit ([D-]HH:MM:SS, UNLIMITED)
    run_time: str = ""  # scontrol's RunTime when asked
    why: Optional[dict] = None  # a failed job: {code, reason, line, fix, source} (core.job_exit)
    reason_words: str = ""  # Slurm's pending reason in words (core.reasons), with what to do
    record: Optional[dict] = None  # its exit record, job_exits/<role>-<id>.json


@dataclass
class RunStatus:
    run_dir: str
    state: str = "unknown"  # running, queued, stopped, finished, not started, unknown (see .liveness)
    state_detail: str = ""  # why: the lock's holder, the ranks' pids and last beats, the Slurm job
    problems: List[str] = field(default_factory=list)  # "PATH[:LINE]: what is wrong" for each broken record
    jobs: List[JobStatus] = field(default_factory=list)
    latest_checkpoint_step: Optional[int] = None  # the newest checkpoint resume would use
    checkpoint_steps: List[int] = field(default_factory=list)  # complete checkpoints that pass the health check
    skipped_checkpoints: List[dict] = field(default_factory=list)  # {"step", "path", "problem"}: resume skips them
    quarantined: List[str] = field(default_factory=list)  # step-N.corrupt directories set aside at resume
    train_exit: Optional[dict] = None  # train_exit.json plus "meaning" of its exit code
    requeue_marker: bool = False
    consolidated_dir: str = ""
    consolidated: str = "absent"  # absent, present, verified, verification failed
    consolidated_ema_dir: str = ""  # the EMA's model (train.ema_decay), when it exists
    consolidated_ema: str = "absent"
    verification: Optional[dict] = None
    last_eval: Optional[dict] = None
    data: Optional[dict] = None  # the prepared token cache: path, samples, tokens, trained tokens
    progress: Optional[Progress] = None  # step, pace, ETA, Slurm time left, requeues, last metrics
    code: Optional[dict] = None  # provenance.json: the code snapshot's sha256 and files, git revision and dirtiness
    notes: List[str] = field(default_factory=list)
    heartbeats: List[dict] = field(default_factory=list)  # per rank: host, pid, age_s, stale, alive
    resume_command: str = ""  # shell-quoted; for a stopped run with a checkpoint
    consolidate_command: str = ""  # shell-quoted; for a stopped run with a checkpoint and no model
    config_changed: str = ""  # config.yaml is not the file planned (its sha256 differs from provenance.json)
    debris: List[str] = field(default_factory=list)  # staging left behind: .hf_model.tmp-*, code/.*.tmp, pending evals
    chain: str = ""  # the chain as a whole: running, queued, done, failed, stuck (see chain_outcome)


def _run(argv: List[str], timeout_s: float = 15) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as err:
        return subprocess.CompletedProcess(argv, 127, "", str(err))


def read_jobs(layout: RunDir) -> List[tuple]:
    """``(role, job id)`` pairs of RUN_DIR/jobs.txt, oldest first."""
    return layout.submitted_jobs()


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
    """(record or None, note). sacct may be disabled: the note says so.

    sacct has no restart count (22.05 refuses a ``Restarts`` field): :func:`job_status`
    takes it from the training log instead.
    """
    proc = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,Reason"])
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        if "disabled" in msg.lower():
            return None, "sacct: job accounting is disabled on this cluster"
        return None, f"sacct failed: {msg}" if msg else "sacct unavailable"
    for line in proc.stdout.splitlines():
        cols = line.split("|")
        if len(cols) >= 2 and cols[0] == job_id:
            cols += [""] * (4 - len(cols))
            return {"JobState": cols[1], "ExitCode": cols[2], "Reason": cols[3]}, ""
    return None, "unknown to sacct"


def _log_for(layout: RunDir, role: str, job_id: str) -> Optional[str]:
    log = layout.log_file(role, job_id)
    return str(log) if log.exists() else None


def restarts_from_log(log: Path) -> tuple:
    """What a training log says about requeues.

    Returns:
        (highest K, MAX) of the batch script's ``restart K/MAX`` lines, or (None, None)
        when there is none, and the last line saying the requeues are spent ("" if none).
    """
    restarts = max_requeues = None
    message = ""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                m = _RESTART_LINE.match(line)
                if m:
                    k, top = int(m.group(1)), int(m.group(2))
                    restarts = k if restarts is None else max(restarts, k)
                    max_requeues = top
                    if _OUT_OF_REQUEUES in line:
                        message = line.strip()
    except OSError:
        pass
    return restarts, max_requeues, message


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
        st.time_limit, st.run_time = rec.get("TimeLimit", ""), rec.get("RunTime", "")
        try:
            st.restarts = int(rec.get("Restarts", "0") or 0)
        except ValueError:
            st.restarts = 0
    if st.log is not None and role == "train":
        logged, st.max_requeues, st.message = restarts_from_log(Path(st.log))
        if logged is not None and (rec is None or "Restarts" not in rec):
            st.restarts = logged  # slurmctld forgot the job (sacct keeps no restart count)
    if rec is not None:
        st.status = classify(st.slurm_state, st.restarts, st.reason)
    st.record = read_record(layout.job_exit(role, job_id))
    if st.status == "unknown" and st.record is not None and isinstance(st.record.get("exit_code"), int):
        # slurmctld and sacct forgot the job: its own record is the last word
        st.status = "done" if st.record["exit_code"] == 0 else "failed"
        st.exit_code = f"{st.record['exit_code']}:0"
        st.source = f"{layout.job_exit(role, job_id)} ({st.source})"
    if st.status in ("failed", "cancelled") or (st.status == "done" and st.exit_code not in ("", "0:0")):
        why = explain(st.record, st.exit_code, Path(st.log) if st.log else None, layout.root)
        st.why = why.to_dict() if why is not None else None
    if st.status == "cancelled" and st.reason and st.reason not in ("None", "NonZeroExitCode"):
        st.reason_words = explain_reason(st.reason).words  # DependencyNeverSatisfied: why it never ran
    if st.status in ("queued", "requeued") and st.reason:
        words = explain_reason(st.reason)
        st.reason_words = words.words + ("" if words.fix == "wait" else f"; {words.fix}")
        if st.reason.startswith("JobHeld"):
            st.status = "held"
            st.reason_words = (f"held by you: it starts after scontrol release {job_id}" if st.reason == "JobHeldUser"
                               else "held by an admin: ask them to release it")
    return st


def _json_object(path: Path, problems: List[str]) -> Optional[dict]:
    """The JSON object in ``path``; None when it is absent, or broken (then said in ``problems``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        problems.append(f"{path}: unreadable: {err.strerror or err}")
        return None
    try:
        obj = json.loads(text)
    except ValueError as err:
        problems.append(f"{path}: not JSON ({err})" if text.strip() else f"{path}: empty")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{path}: not a JSON object (a {type(obj).__name__})")
        return None
    return obj


def _train_exit(layout: RunDir, problems: List[str]) -> Optional[dict]:
    """``train_exit.json`` with the meaning of its code (None when the trainer never finished a run)."""
    rec = _json_object(layout.train_exit, problems)
    if rec is None:
        return None
    code = rec.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool):
        problems.append(f"{layout.train_exit}: no integer exit_code (found {code!r})")
    rec["meaning"] = MEANINGS.get(code, "unknown exit code") if isinstance(code, int) else "no exit code recorded"
    return rec


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
    sources = describe_sources(cache.meta)  # a mixture: one line per source (fsdp_workflow.data.mixture)
    if sources:
        out["sources"] = sources
    return out


def _code_record(prov: Optional[dict]) -> Optional[dict]:
    """What ``provenance.json`` says about the code the jobs run (None without a readable one)."""
    if prov is None:
        return None
    snap = prov.get("code_snapshot") if isinstance(prov.get("code_snapshot"), dict) else None
    return {"snapshot_sha256": snap.get("sha256") if snap else None, "snapshot_path": snap.get("path") if snap else None,
            "git_revision": prov.get("git_revision"), "git_dirty": prov.get("git_dirty")}


def _consolidated(out: Path, problems: List[str]) -> tuple:
    """(absent | present | verified | verification failed | present (unreadable ...), verification.json)."""
    if not out.is_dir():
        return "absent", None
    vpath = out / "verification.json"
    if not vpath.is_file():
        return "present", None
    verification = _json_object(vpath, problems)
    if verification is None:
        return "present (unreadable verification.json)", None
    return ("verified" if verification.get("ok") else "verification failed"), verification


def _config(layout: RunDir, problems: List[str]) -> Dict[str, Any]:
    """config.yaml as plain data (``{}``, said in ``problems``, when it cannot be read)."""
    try:
        cfg = yaml.safe_load(layout.config.read_text())
    except OSError as err:
        problems.append(f"{layout.config}: unreadable: {err.strerror or err}")
        return {}
    except yaml.YAMLError as err:
        problems.append(f"{layout.config}: not YAML ({' '.join(str(err).split())})")
        return {}
    if not isinstance(cfg, dict):
        problems.append(f"{layout.config}: not a mapping of config keys")
        return {}
    return cfg


def _last_eval(layout: RunDir, problems: List[str]) -> Optional[dict]:
    """The last well-formed line of evals.jsonl; every broken line is said in ``problems``."""
    try:
        lines = layout.evals_file.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    except OSError as err:
        problems.append(f"{layout.evals_file}: unreadable: {err.strerror or err}")
        return None
    last = None
    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            problems.append(f"{layout.evals_file}:{num}: not JSON")
            continue
        if isinstance(rec, dict):
            last = rec
        else:
            problems.append(f"{layout.evals_file}:{num}: not a JSON object")
    return last


def collect(run_dir: Path) -> RunStatus:
    """Everything :func:`main` prints, as data."""
    layout = RunDir.recorded(run_dir)  # cluster.log_dir and consolidate.output_dir as the run recorded them
    rs = RunStatus(run_dir=str(layout.root))
    cfg = _config(layout, rs.problems)
    for role, job_id in read_jobs(layout):
        rs.jobs.append(job_status(layout, role, job_id))
    cluster = cfg.get("cluster") if isinstance(cfg.get("cluster"), dict) else {}
    if not rs.jobs and cluster.get("kind") == "slurm":  # a local run submits nothing: no jobs.txt
        rs.notes.append(f"no {JOBS_FILE}: nothing was submitted from this run directory yet")
    # complete checkpoints only, by the trainer's own rule (a step-N without .metadata is not one),
    # and of those the ones resume would not skip (a truncated shard, a garbled .metadata)
    for step, path in layout.list_checkpoints():
        problem = checkpoint_problem(path)
        if problem is None:
            rs.checkpoint_steps.append(step)
        else:
            rs.skipped_checkpoints.append({"step": step, "path": str(path), "problem": problem})
    rs.latest_checkpoint_step = rs.checkpoint_steps[-1] if rs.checkpoint_steps else None
    rs.quarantined = [str(p) for p in layout.quarantined()]
    provenance = _json_object(layout.provenance, rs.problems)
    rs.code = _code_record(provenance)
    rs.train_exit = _train_exit(layout, rs.problems)
    rs.requeue_marker = layout.requeue_marker.exists()
    rs.data = _data_summary(layout)
    rs.progress = run_progress(layout, rs.jobs)
    rs.problems += read_series(layout.metrics).problems
    rs.consolidated_dir = str(layout.hf_model)
    rs.consolidated, rs.verification = _consolidated(layout.hf_model, rs.problems)
    if layout.hf_model_ema.is_dir():  # train.ema_decay: the EMA's model beside it
        rs.consolidated_ema_dir = str(layout.hf_model_ema)
        rs.consolidated_ema = _consolidated(layout.hf_model_ema, rs.problems)[0]
    rs.last_eval = _last_eval(layout, rs.problems)
    rs.config_changed = _config_changed(layout, provenance)
    rs.debris = _debris(layout, rs.jobs)
    _liveness(rs, layout, cfg, provenance)
    rs.chain = chain_outcome(rs)[0]
    return rs


def _config_changed(layout: RunDir, provenance: Optional[dict]) -> str:
    """The message when config.yaml is not the file that was planned (provenance.json's ``config_sha256``)."""
    planned = (provenance or {}).get(PROVENANCE_KEY)
    if not isinstance(planned, str) or not planned:
        return ""  # planned before the hash was recorded: nothing to compare with
    return "" if file_sha256(layout.config) == planned else changed_message(layout.root)


_LIVE = ("queued", "requeued", "running", "held")


def _debris(layout: RunDir, jobs: List[JobStatus]) -> List[str]:
    """Staging directories nothing will finish: a consolidation's ``.NAME.tmp-PID``, the code snapshot's
    ``code/.*.tmp``, and pending evaluation links once no evaluation job is live."""
    found: List[Path] = []
    for model in (layout.hf_model, layout.hf_model_ema):
        if model.parent.is_dir():
            found += sorted(model.parent.glob(f".{model.name}.tmp-*"))
    if layout.code.is_dir():
        found += sorted(p for p in layout.code.iterdir() if p.name.startswith(".") and p.name.endswith((".tmp", ".old")))
    evals_live = any(j.role.startswith("eval") and j.status in _LIVE for j in jobs)
    if layout.pending_evals.is_dir() and not evals_live:
        found += sorted(layout.pending_evals.iterdir())
    live = any(j.status in _LIVE for j in jobs if j.role in ("consolidate",))
    return [str(p) for p in found if not (live and p.name.startswith(f".{layout.hf_model.name}.tmp-"))]


def chain_outcome(rs: RunStatus) -> tuple:
    """Where the chain as a whole stands, for ``--watch``: (word, exit code or None while it can progress).

    ``done`` (0): every job done, or a local run finished. ``failed`` (the first failed job's
    code, else 1): a job failed or was cancelled and nothing is left to run. ``stuck`` (2): a
    job waits for something that never comes (a pending reason that means never). Else live.
    """
    if not rs.jobs:
        if rs.state == "finished":
            return "done", 0
        if rs.state == "stopped":
            code = (rs.train_exit or {}).get("exit_code")
            return "failed", code if isinstance(code, int) and code else 1
        return rs.state, None
    for j in rs.jobs:
        if j.status in ("queued", "requeued") and j.reason and explain_reason(j.reason).never:
            return "stuck", 2
    if any(j.status in _LIVE for j in rs.jobs):
        return "running" if any(j.status == "running" for j in rs.jobs) else "queued", None
    if any(j.status == "unknown" for j in rs.jobs):
        return "unknown", None
    # the newest submission decides: an earlier chain's failure does not fail one resubmitted since
    head = "prepare" if any(j.role == "prepare" for j in rs.jobs) else "train"
    start = max((i for i, j in enumerate(rs.jobs) if j.role == head), default=0)
    bad = [j for j in rs.jobs[start:] if j.status in ("failed", "cancelled")]
    if not bad:
        return "done", 0
    code = (bad[0].why or {}).get("exit_code")
    return "failed", code if isinstance(code, int) and 0 < code < 256 else 1


def _liveness(rs: RunStatus, layout: RunDir, cfg: Dict[str, Any], provenance: Optional[dict]) -> None:
    """Whether the run is alive; a run that is not gets no ETA, and the commands to continue it."""
    beats = read_heartbeats(layout, rs.problems)
    code = (rs.train_exit or {}).get("exit_code")
    code = code if isinstance(code, int) else None
    if rs.jobs:
        live = slurm_liveness([j.status for j in rs.jobs], [j.role for j in rs.jobs], beats, code)
    else:
        ran = rs.progress is not None and rs.progress.step is not None
        live = local_liveness(layout, beats, ran or rs.train_exit is not None, code)
    rs.state, rs.state_detail, rs.heartbeats = live.state, live.detail, live.ranks
    if rs.state != "running" and rs.progress is not None:
        rs.progress.eta_s = None  # nothing is training (queued, held, failed, cancelled): a time left would be a lie
    if rs.state != "stopped" or rs.latest_checkpoint_step is None:
        return
    cluster = cfg.get("cluster") if isinstance(cfg.get("cluster"), dict) else {}
    planned = provenance.get("command") if provenance and isinstance(provenance.get("command"), list) else None
    rs.resume_command = shell(resume_argv(layout, planned, slurm=cluster.get("kind") == "slurm"))
    if rs.consolidated == "absent":
        rs.consolidate_command = shell(consolidate_argv(layout))
