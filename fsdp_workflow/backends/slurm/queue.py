"""Slurm's queue, read in one place: job states, ``squeue``, ``scontrol -o`` and ``sacct`` output.

Every reader of the queue asks here: the pending-reason watch and the chain guard
(``squeue``), the cluster's limits (``scontrol show partition|node -o``), ``status``
and the API's handles (``scontrol show job -o``, then ``sacct``). :class:`JobState`
is the one vocabulary of job states; ``submit.sh``'s live-chain rule is rendered
from :data:`TERMINAL_STATES`.

A pure part of the backends (it imports ``core`` and :mod:`fsdp_workflow.backends.base`
alone): the planner, which renders ``submit.sh``, reads it from below the backends stage.
:class:`JobState` is the backends' own vocabulary (:mod:`fsdp_workflow.backends.base`).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from fsdp_workflow.backends.base import TERMINAL_STATES, JobState, SchedulerUnreachable

SQUEUE_FORMAT = "%i|%T|%r"  # job id, state, reason: what :func:`parse_squeue` reads
SACCT_FIELDS = "JobID,State,ExitCode,Reason"  # what :func:`parse_sacct` reads (-n -P -X)

# Key=Value tokens of one ``-o`` record; values may hold spaces (``OS=Linux 6.1 #1 SMP``, a path).
_FIELD_SPLIT = re.compile(r" +(?=[A-Za-z][A-Za-z0-9_/:.]*=)")


@dataclass(frozen=True)
class QueuedJob:
    """One line of ``squeue -o`` :data:`SQUEUE_FORMAT`."""

    job_id: str
    state: JobState
    reason: str  # Slurm's reason code ("None" when it has none yet)


class SlurmUnreachable(SchedulerUnreachable):
    """A Slurm command is missing or did not answer; the message says which and why."""


def parse_record(line: str) -> Dict[str, str]:
    """One ``scontrol -o show ...`` line as ``{Key: Value}``."""
    out: Dict[str, str] = {}
    for token in _FIELD_SPLIT.split(line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value.strip()
    return out


def parse_squeue(text: str) -> Dict[str, QueuedJob]:
    """``squeue -h -o`` :data:`SQUEUE_FORMAT` output, by job id."""
    out: Dict[str, QueuedJob] = {}
    for line in text.splitlines():
        cols = line.strip().split("|", 2)
        if len(cols) >= 2 and cols[0]:
            out[cols[0]] = QueuedJob(cols[0], JobState.parse(cols[1]), cols[2] if len(cols) > 2 else "")
    return out


def parse_sacct(text: str, job_id: str) -> Optional[Dict[str, str]]:
    """``sacct -n -P -X -o`` :data:`SACCT_FIELDS` output: ``job_id``'s record, keyed as scontrol keys it."""
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) >= 2 and cols[0] == job_id:
            cols += [""] * (4 - len(cols))
            return {"JobState": cols[1], "ExitCode": cols[2], "Reason": cols[3]}
    return None


def _run(argv: List[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run a read-only Slurm command (never raises: a missing or silent one is exit 127)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as err:
        return subprocess.CompletedProcess(argv, 127, "", str(err))


def hostnames(nodelist: str, timeout_s: float = 20) -> List[str]:
    """A job step's hosts in node-id order (``scontrol show hostnames``); [] when Slurm does not say."""
    if not nodelist:
        return []
    proc = _run(["scontrol", "show", "hostnames", nodelist], timeout_s)
    return proc.stdout.split() if proc.returncode == 0 else []


@dataclass(frozen=True)
class SlurmQueue:
    """Asks slurmctld (and slurmdbd) about jobs; every answer parsed by this module's parsers.

    Attributes:
        timeout_s: the longest wait for one command (a busy controller can be slow).
    """

    timeout_s: float = 30

    def squeue(self, job_ids: Sequence[str]) -> Dict[str, QueuedJob]:
        """The jobs of ``job_ids`` squeue still lists (an id it has forgotten is absent).

        Raises:
            SlurmUnreachable: squeue is missing, timed out, or failed for another reason than unknown ids.
        """
        if not job_ids:
            return {}
        proc = _run(["squeue", "-h", "-j", ",".join(job_ids), "-o", SQUEUE_FORMAT], self.timeout_s)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip()
            if "Invalid job id" in msg:  # every id is forgotten: none is listed
                return {}
            raise SlurmUnreachable(f"squeue failed: {msg or proc.returncode}")
        return parse_squeue(proc.stdout)

    def show_job(self, job_id: str) -> Optional[Dict[str, str]]:
        """``scontrol -o show job``'s record; None when slurmctld no longer knows the job or does not answer."""
        proc = _run(["scontrol", "-o", "show", "job", job_id], self.timeout_s)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        return parse_record(proc.stdout.splitlines()[0])

    def state(self, job_id: str) -> JobState:
        """The job's state as slurmctld knows it; UNKNOWN when it does not (any more)."""
        return JobState.parse((self.show_job(job_id) or {}).get("JobState", ""))

    def sacct(self, job_id: str) -> Tuple[Optional[Dict[str, str]], str]:
        """``(record or None, note)`` from accounting; the note says why there is none (accounting disabled...)."""
        proc = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", SACCT_FIELDS], self.timeout_s)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip()
            if "disabled" in msg.lower():
                return None, "sacct: job accounting is disabled on this cluster"
            return None, f"sacct failed: {msg}" if msg else "sacct unavailable"
        record = parse_sacct(proc.stdout, job_id)
        return (record, "") if record is not None else (None, "unknown to sacct")


__all__ = ["JobState", "QueuedJob", "SACCT_FIELDS", "SQUEUE_FORMAT", "SlurmQueue", "SlurmUnreachable",
           "TERMINAL_STATES", "hostnames", "parse_record", "parse_sacct", "parse_squeue"]
