"""Collect where a submitted run stands (``RunStatus``): its Slurm jobs, latest checkpoint, model, evaluations.

Every file of the run directory is read through the run record
(:class:`~fsdp_workflow.config.record.RunRecord`): the typed config, provenance, jobs,
exit records, the metrics and evals series, checkpoints and consolidated models.
Each job's state comes from Slurm (:mod:`.jobs`). Also shown: the trainer's
``train_exit.json`` (code, meaning, reason), and
which checkpoints resume will use: complete ``step-N`` that fail the cheap
:func:`~fsdp_workflow.core.checkpoint_health.checkpoint_problem` check are named
with the reason resume will skip them, and ``step-N.corrupt`` ones set aside.

Nothing broken is skipped in silence: a record that cannot be read (``train_exit.json``,
``provenance.json``, ``config.yaml``, a line of ``metrics.jsonl`` or ``evals.jsonl``, a
heartbeat) is listed in ``problems`` with its file, its line and what is wrong. Whether
the run is alive comes from :mod:`.liveness`; a stopped run gets no ETA, and the commands
to resume or consolidate it (:mod:`.paste_commands`, shell-quoted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from fsdp_workflow.backends.base import JobStatus
from fsdp_workflow.backends.registry import backend_for, backend_of_run
from fsdp_workflow.config.record import RunRecord, open_run
from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.config_hash import PROVENANCE_KEY, changed_message, file_sha256
from fsdp_workflow.core.exit_codes import MEANINGS
from fsdp_workflow.backends.slurm.reasons import explain as explain_reason
from fsdp_workflow.core.rundir import JOBS_FILE, PathLike, RunDir
from fsdp_workflow.data.cache import CacheError
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.report.run_sources import source_lines
from fsdp_workflow.report.status.paste_commands import consolidate_argv, resume_argv, shell
from fsdp_workflow.report.status.eta import Progress, run_progress
from fsdp_workflow.report.status.liveness import local_liveness, read_heartbeats, slurm_liveness

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


def _train_exit(record: RunRecord) -> Optional[dict]:
    """``train_exit.json`` with the meaning of its code (None when the trainer never finished a run)."""
    rec = record.train_exit
    if rec is None:
        return None
    rec = dict(rec)
    code = rec.get("exit_code")
    rec["meaning"] = MEANINGS.get(code, "unknown exit code") if isinstance(code, int) else "no exit code recorded"
    return rec


def _data_summary(layout: RunDir, record: Optional[RunRecord] = None) -> Optional[dict]:
    """What the prepare step left: the cache this run trains on, its counts and its sources (None before it ran)."""
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
    sources = source_lines(record if record is not None else open_run(layout.root), cache.meta)
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


def collect(run_dir: PathLike, record: Optional[RunRecord] = None) -> RunStatus:
    """Everything :func:`main` prints, as data.

    Args:
        run_dir: the run directory.
        record: its record, when the caller already opened it (every file is read once).

    Returns:
        The status; each file or line that could not be read is named in ``problems``.
    """
    rec = record if record is not None else open_run(run_dir)
    cfg = rec.config  # typed; None (said in problems) when config.yaml does not load
    layout = rec.layout  # cluster.log_dir and consolidate.output_dir as the run recorded them
    rs = RunStatus(run_dir=str(layout.root))
    backend = backend_of_run(cfg)  # the scheduler that ran the jobs of jobs.txt says where each stands
    for role, job_id in rec.jobs:
        rs.jobs.append(backend.job_status(rec, role, job_id))
    if not rs.jobs and cfg is not None and backend_for(cfg).queued:  # a local run submits nothing
        rs.notes.append(f"no {JOBS_FILE}: nothing was submitted from this run directory yet")
    # complete checkpoints only, by the trainer's own rule (a step-N without .metadata is not one),
    # and of those the ones resume would not skip (a truncated shard, a garbled .metadata)
    for step, path in rec.checkpoints:
        problem = checkpoint_problem(path)
        if problem is None:
            rs.checkpoint_steps.append(step)
        else:
            rs.skipped_checkpoints.append({"step": step, "path": str(path), "problem": problem})
    rs.latest_checkpoint_step = rs.checkpoint_steps[-1] if rs.checkpoint_steps else None
    rs.quarantined = [str(p) for p in layout.quarantined()]
    rs.code = _code_record(rec.provenance)
    rs.train_exit = _train_exit(rec)
    rs.requeue_marker = layout.requeue_marker.exists()
    rs.data = _data_summary(layout, rec)
    rs.progress = run_progress(rec, rs.jobs)
    rs.consolidated_dir, rs.consolidated = str(rec.model.path), rec.model.state
    rs.verification = rec.model.verification
    if rec.model_ema.state != "absent":  # train.ema_decay: the EMA's model beside it
        rs.consolidated_ema_dir, rs.consolidated_ema = str(rec.model_ema.path), rec.model_ema.state
    rs.last_eval = rec.evals.last()
    rs.config_changed = _config_changed(layout, rec.provenance)
    rs.debris = _debris(layout, rs.jobs)
    _liveness(rs, rec)
    rs.problems = list(rec.problems) + rs.problems  # the record's, in the order its files were read
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


def _liveness(rs: RunStatus, rec: RunRecord) -> None:
    """Whether the run is alive; a run that is not gets no ETA, and the commands to continue it."""
    layout = rec.layout
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
    provenance = rec.provenance
    planned = provenance.get("command") if provenance and isinstance(provenance.get("command"), list) else None
    slurm = rec.config is not None and rec.config.cluster.kind.value == "slurm"
    rs.resume_command = shell(resume_argv(layout, planned, slurm=slurm))
    if rs.consolidated == "absent":
        rs.consolidate_command = shell(consolidate_argv(layout))
