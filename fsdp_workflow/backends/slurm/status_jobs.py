"""One Slurm job of a run as ``status`` sees it (a :class:`JobStatus`): state, restarts, log, exit record, why.

The state comes from ``scontrol show job`` (it answers without accounting, for MinJobAge
after the end), then ``sacct`` for jobs slurmctld has forgotten; when accounting is
disabled that is said, not hidden. A training job's restarts come from ``scontrol``
(``Restarts``), else from the ``restart k/M`` lines its batch script logs. The job's own
exit record (``job_exits/``) comes from the run record. The Slurm backend's
:meth:`~fsdp_workflow.backends.slurm.backend.SlurmBackend.job_status`; the type is every backend's
(:class:`~fsdp_workflow.backends.base.JobStatus`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from fsdp_workflow.backends.base import JobStatus
from fsdp_workflow.config.record import RunRecord
from fsdp_workflow.core.job_exit import explain
from fsdp_workflow.backends.slurm.reasons import explain as explain_reason
from fsdp_workflow.backends.slurm.queue import JobState, SlurmQueue

_QUEUE = SlurmQueue(timeout_s=15)  # status answers quickly, even from a busy login node
# train.sbatch logs "[fsdp_workflow] train job N restart K/MAX ..." at every start (and when it refuses one).
_RESTART_LINE = re.compile(r"^\[fsdp_workflow\] .*\brestart (\d+)/(\d+)\b")
# What train.sbatch says when the requeues are spent (either route); shown as a note.
_OUT_OF_REQUEUES = "cluster.max_requeues="


def classify(slurm_state: str, restarts: int, reason: str) -> str:
    """Our status word for a Slurm state; a pending job that ran before is ``requeued``."""
    status = JobState.parse(slurm_state).word
    if status == "queued" and restarts > 0:
        return "requeued"
    return status


def _log_for(record: RunRecord, role: str, job_id: str) -> Optional[str]:
    log = record.layout.log_file(role, job_id)
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


def job_status(record: RunRecord, role: str, job_id: str) -> JobStatus:
    """Where job ``job_id`` of the run stands, and why it failed when it did.

    Args:
        record: the run's record (its layout names the log and the exit record).
        role: ``prepare``, ``train``, ``consolidate`` or ``eval-step-N``.
        job_id: the Slurm job id.

    Returns:
        The job's status; ``unknown`` when neither Slurm nor an exit record knows it.
    """
    layout = record.layout
    rec, source = _QUEUE.show_job(job_id), "scontrol"
    if rec is None:
        rec, note = _QUEUE.sacct(job_id)
        source = "sacct" if rec is not None else f"slurmctld no longer knows the job; {note}"
    st = JobStatus(role=role, job_id=job_id, status="unknown", source=source, log=_log_for(record, role, job_id))
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
    st.record = record.job_exit(role, job_id)
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
