"""The roles of a run's jobs, one word each: what the planner, the container wrap and every backend call them.

Pure (imports nothing), on the floor every stage may import: the planner (``plan/jobs.py``),
the container stage (a role is the step a runtime wraps) and every backend name jobs by it;
:mod:`fsdp_workflow.backends.base` offers it with the protocol. (It lived in ``backends/``, a
floor above two of its readers: issue 50.)
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """A job's role in the chain, and the container step it runs.

    The word names the batch script (``eval.sbatch``), the log's prefix, the job's line in
    ``jobs.txt`` and the step a container runtime wraps; ``eval`` it is (``evaluate`` is the
    module the job runs). A member formats as its word (``f"{Role.train}_id"`` is
    ``train_id``), so rendered scripts read as before, on every Python.
    """

    prepare = "prepare"
    train = "train"
    consolidate = "consolidate"
    eval = "eval"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


__all__ = ["Role"]
