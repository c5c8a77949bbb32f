"""What every scheduler backend offers, and the words they share: roles, job states, refusals.

A backend is a peer of the others behind :class:`Backend`, as submitit's ``Executor``
keeps Slurm, local and debug apart: ``issues``, ``plan``, ``render``, ``submit``,
``states``, ``cancel``, ``live``, ``job_status``. :mod:`fsdp_workflow.backends.registry` picks one by
``cluster.kind``; callers ask it, never the kind itself.

This module imports ``core`` alone (the config and plan types are for type checkers): the report
stage reads :class:`JobState` from here; :class:`Role` is :mod:`fsdp_workflow.core.roles`'s, on the
floor every stage may import (the planner and the container stage name jobs by it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence, Tuple

from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.core.roles import Role

if TYPE_CHECKING:
    from fsdp_workflow.config.errors import Issue, ValidationReport
    from fsdp_workflow.config.record import RunRecord
    from fsdp_workflow.config.schema import WorkflowConfig
    from fsdp_workflow.core.lock import Lock
    from fsdp_workflow.core.rundir import RunDir
    from fsdp_workflow.plan.jobs import LaunchPlan


class JobState(str, Enum):
    """A job's state (Slurm's words: squeue ``%T``, scontrol ``JobState``, sacct ``State``), and what it means here.

    Every backend answers :meth:`Backend.states` in these words; a scheduler with fewer
    states uses the ones that mean the same (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``).
    """

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    STAGE_OUT = "STAGE_OUT"
    SIGNALING = "SIGNALING"
    SUSPENDED = "SUSPENDED"
    RESIZING = "RESIZING"
    STOPPED = "STOPPED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    REVOKED = "REVOKED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    PREEMPTED = "PREEMPTED"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    UNKNOWN = "UNKNOWN"  # not a Slurm state: one we do not know, or none was read

    @classmethod
    def parse(cls, text: str) -> "JobState":
        """``CANCELLED by 0``, ``COMPLETED+`` or ``RUNNING`` as a state; UNKNOWN for anything else."""
        word = (text.split() or [""])[0].rstrip("+").upper()
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    @property
    def word(self) -> str:
        """What ``status`` tells the user: queued, requeued, running, done, cancelled, failed or unknown."""
        return _WORDS.get(self, "unknown")

    @property
    def ended(self) -> bool:
        """The job will not run again (Slurm's terminal states); UNKNOWN has not ended."""
        return self.word in ("done", "cancelled", "failed")


_WORDS = {
    JobState.PENDING: "queued", JobState.CONFIGURING: "queued", JobState.RESV_DEL_HOLD: "queued",
    JobState.REQUEUED: "requeued", JobState.REQUEUE_FED: "requeued", JobState.REQUEUE_HOLD: "requeued",
    JobState.RUNNING: "running", JobState.COMPLETING: "running", JobState.STAGE_OUT: "running",
    JobState.SIGNALING: "running", JobState.SUSPENDED: "running", JobState.RESIZING: "running",
    JobState.STOPPED: "running",
    JobState.COMPLETED: "done",
    JobState.CANCELLED: "cancelled", JobState.REVOKED: "cancelled",
    JobState.FAILED: "failed", JobState.TIMEOUT: "failed", JobState.NODE_FAIL: "failed",
    JobState.OUT_OF_MEMORY: "failed", JobState.BOOT_FAIL: "failed", JobState.DEADLINE: "failed",
    JobState.PREEMPTED: "failed", JobState.SPECIAL_EXIT: "failed",
}

# The states a job never leaves, by name, sorted: submit.sh's live-chain rule is rendered from them.
TERMINAL_STATES: Tuple[str, ...] = tuple(sorted(s.value for s in JobState if s.ended))


@dataclass
class JobStatus:
    """One job of ``jobs.txt`` as ``status`` shows it; :meth:`Backend.job_status` fills it (the field names
    are ``status --json``'s: a scheduler without Slurm's details leaves them empty)."""

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


class SchedulerUnreachable(RuntimeError):
    """The scheduler could not be asked (its command is missing or did not answer); the message says
    which, why, and where to ask again."""


class Refused(Exception):
    """A step of the submit pipeline refused; ``str(err)`` is what the CLI prints.

    Raised by the pipeline (:mod:`fsdp_workflow.launch.pipeline`) and by a backend's submission;
    the API raises them again as :class:`fsdp_workflow.api.SubmitError`.

    Attributes:
        exit_code: the CLI's exit code (2: config, run directory, cluster; 1: submission failed otherwise).
        issues: the config problems, one per key (empty when the refusal is not about a key).
        report: the validation's report, when validation refused (its notes and warnings are printed too).
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE, issues: Sequence["Issue"] = (),
                 report: Optional["ValidationReport"] = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.issues = list(issues)
        self.report = report


def refused(body: str, heading: str = "invalid config", issues: Sequence["Issue"] = ()) -> Refused:
    """A refusal (exit 2) worded as the CLI's: ``fsdp_workflow: HEADING`` then the body."""
    return Refused(f"fsdp_workflow: {heading}\n{body}", EXIT_USAGE, issues)


class Backend(Protocol):
    """A scheduler: plans a chain, renders its scripts, runs or submits it, and reads its jobs back.

    Attributes:
        kind: the ``cluster.kind`` value it serves (the registry's key).
        queued: jobs wait in a scheduler's queue and :meth:`submit` returns at once; False: the
            chain runs here, in the foreground, and :meth:`submit` returns when it has ended.
    """

    kind: str
    queued: bool

    def issues(self, cfg: "WorkflowConfig", plan: "LaunchPlan") -> "ValidationReport":
        """What only this scheduler knows is wrong with the plan (a partition's limits), read now.

        Returns:
            Errors (a job could never start) and warnings; its notes say what was checked, for the
            line ``fsdp_workflow.check`` prints when nothing is wrong (none: nothing to check).

        Raises:
            SchedulerUnreachable: the scheduler did not answer (the message says where to run it).
        """
        ...

    def plan(self, cfg: "WorkflowConfig", layout: "RunDir") -> "LaunchPlan":
        """The chain as data: its jobs (role, argv, after, resources) in order, for ``layout``'s run."""
        ...

    def render(self, plan: "LaunchPlan") -> Dict[str, str]:
        """Every script of the run directory, by file name."""
        ...

    def submit(self, cfg: "WorkflowConfig", plan: "LaunchPlan", lock: Optional["Lock"] = None) -> int:
        """Run or submit the written chain; the CLI's exit code (messages printed).

        Args:
            cfg: the run's config.
            plan: the plan the run directory was written from.
            lock: the run directory's lock, held by the caller (a foreground run holds it to the end).
        """
        ...

    def states(self, job_ids: Sequence[str]) -> Dict[str, JobState]:
        """Each job's state; UNKNOWN for one the scheduler does not know (any more)."""
        ...

    def cancel(self, job_ids: Sequence[str]) -> None:
        """Cancel the jobs (an ended or unknown one is no error)."""
        ...

    def live(self, layout: "RunDir") -> Optional[str]:
        """Why a chain of this run directory is still queued or running, or None: a second may start."""
        ...

    def dry_run_notes(self, run_dir: str) -> List[str]:
        """Lines a dry run prints after what it wrote (what it did not check)."""
        ...

    def submit_command(self, layout: "RunDir") -> Optional[List[str]]:
        """The argv that submits a dry run's chain later, as this backend submits it (None: it has none)."""
        ...

    def job_status(self, record: "RunRecord", role: str, job_id: str) -> JobStatus:
        """What ``status`` says about job ``job_id`` of ``jobs.txt`` (``role``: its line's first word)."""
        ...


__all__ = ["Backend", "JobState", "JobStatus", "Refused", "Role", "SchedulerUnreachable", "TERMINAL_STATES", "refused"]
