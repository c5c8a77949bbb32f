"""submitit job handles for the jobs that our own ``sbatch`` submission returned.

submitit's executor writes a batch script of its own around a pickled function;
the chain runs the run directory's scripts instead (:mod:`fsdp_workflow.backends.slurm.submit`
says why). What submitit gives a notebook user is the job handle: ``state``,
``done()``, ``wait()``, ``cancel()``, ``stdout()``, ``paths``. A :class:`ChainJob`
is a ``submitit.SlurmJob`` built for a job id that ``sbatch`` returned, whose
paths name that job's log and batch script in the run directory.

    job = ChainJob(layout.logs, "1234", role="train", log=layout.log_file("train", "1234"),
                   script=layout.script("train.sbatch"))
    job.wait(); job.state  # "COMPLETED"

Two things differ from a job submitit submitted itself, because no pickled function
ran: ``result()`` returns None once the job COMPLETED and raises submitit's
``FailedJobError`` (with the log's tail) when it ended otherwise; and ``stdout()``
and ``stderr()`` both read the one log (the jobs pass ``--output`` and no ``--error``).

submitit reads job states from ``sacct``. Where accounting is off, or slurmdbd has
not heard of a new job yet, sacct says nothing and the state would stay UNKNOWN, so
:class:`_Watcher` asks ``scontrol show job`` for the jobs sacct left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Set, Tuple

from submitit.core.utils import JobPaths, UncompletedJobError
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from fsdp_workflow.backends.slurm.queue import JobState, SlurmQueue

SCONTROL_TIMEOUT_S = 30
# submitit polls at 0, 2, 4, 8 s... then at most every delay_s: a chain's last job
# is seen ended within this many seconds (submitit's own default is 600).
WATCH_DELAY_S = 15
_LOG_TAIL_CHARS = 3000


def scontrol_state(job_id: str) -> str:
    """``JobState`` from ``scontrol show job`` ("" when Slurm no longer knows the job or does not answer)."""
    return (SlurmQueue(SCONTROL_TIMEOUT_S).show_job(job_id) or {}).get("JobState", "")


class _Watcher(SlurmInfoWatcher):
    """submitit's sacct watcher, with ``scontrol show job`` for the jobs sacct has no state for."""

    def __init__(self, delay_s: int) -> None:
        super().__init__(delay_s=delay_s)
        self._by_scontrol: Set[str] = set()  # states read from scontrol: read again next time

    def update(self) -> None:
        for job_id in self._by_scontrol - self._finished:
            self._info_dict.pop(job_id, None)
        self._by_scontrol.clear()
        super().update()
        for job_id in sorted(self._registered - self._finished):
            if self._info_dict.get(job_id, {}).get("State"):
                continue
            state = scontrol_state(job_id)
            if state:
                self._info_dict[job_id] = {"JobID": job_id, "State": state}
                self._by_scontrol.add(job_id)
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)


class _ChainJobPaths(JobPaths):
    """submitit's paths, pointed at the run directory's log and batch script for one job."""

    def __init__(self, folder: Path, job_id: str, log: Path, script: Path) -> None:
        super().__init__(folder, job_id=job_id, task_id=0)
        self._log, self._script = log, script

    @property
    def stdout(self) -> Path:
        return self._log

    @property
    def stderr(self) -> Path:
        return self._log  # --output without --error: one log holds both streams

    @property
    def submission_file(self) -> Path:
        return self._script


class ChainJob(SlurmJob):
    """A submitit handle for one job of a submitted chain.

    Args:
        folder: the run's log directory (submitit's job folder).
        job_id: the id ``sbatch --parsable`` printed.
        role: the job's role in the chain (``prepare``, ``train``, ``consolidate``...).
        log: the job's log file (``RunDir.log_file``).
        script: the batch script Slurm holds for the job.
    """

    watcher = _Watcher(delay_s=WATCH_DELAY_S)

    def __init__(self, folder: Path, job_id: str, *, role: str, log: Path, script: Path) -> None:
        self.role = role
        super().__init__(folder, job_id)
        self._paths = _ChainJobPaths(Path(folder), job_id, Path(log), Path(script))

    def __repr__(self) -> str:
        return f"ChainJob(role={self.role!r}, job_id={self.job_id!r}, state={self.state!r})"

    def _get_outcome_and_result(self) -> Tuple[str, Any]:
        """``("success", None)`` for a COMPLETED job, else ``("error", why)``; no pickle is read.

        Raises:
            UncompletedJobError: Slurm still lists the job as not ended.
        """
        state = self.watcher.get_state(self.job_id, mode="force")
        if state.upper().startswith("COMPLETED"):
            return "success", None
        if not JobState.parse(state).ended:
            raise UncompletedJobError(f"the {self.role} job {self.job_id} has not ended (state: {state})")
        log = self.stdout() or ""
        return "error", (f"the {self.role} job {self.job_id} ended {state}; the end of its log "
                         f"({self.paths.stdout}):\n{log[-_LOG_TAIL_CHARS:]}")


__all__ = ["ChainJob", "WATCH_DELAY_S", "scontrol_state"]
