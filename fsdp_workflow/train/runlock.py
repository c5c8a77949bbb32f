"""One trainer per run directory: rank 0 holds ``RUN_DIR/.lock`` while training runs.

Two trainers on one run directory would both append to ``metrics.jsonl`` and
race on every checkpoint. Rank 0 therefore takes the run's lock
(:mod:`fsdp_workflow.core.lock`, an ``flock`` the kernel frees when the process
dies) before anything is written into the run, and keeps it to the end:

- under the local launcher (``python -m fsdp_workflow``), the launcher already
  holds the lock for the whole local run; rank 0, its descendant, sees that the
  holder is an ancestor and trains under it;
- on Slurm, or under a ``torchrun`` started by hand, rank 0 takes the lock itself.
  A requeued job takes it back simply because its dead holder's lock was freed;
- held by anyone else, every rank stops before writing anything, with one line
  naming the holder (host, pid, Slurm job): :class:`RunLocked`, exit 2.

The decision crosses ranks in one broadcast at start-up, so no rank trains alone.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch.distributed as dist

from fsdp_workflow.core.lock import Lock, LockHeld, acquire
from fsdp_workflow.core.rundir import RunDir

WHAT = "training (rank 0)"
# The submitting command holds the lock until sbatch has returned for every job, so a
# training job that starts at once (no prepare job, an idle cluster) may find it still
# held by "planning ...": wait that long for it, never for anyone else.
PLANNER_GRACE_S = 120.0


class RunLocked(RuntimeError):
    """Another process holds the run directory's lock; the message names it."""


def hold_run_lock(run: RunDir) -> Optional[Lock]:
    """Rank 0: take the run's lock, or trust an ancestor that holds it; every rank: stop if someone else does.

    Call after the process group exists and before anything is written into ``run``.

    Args:
        run: the run directory.

    Returns:
        The lock rank 0 took (keep it until training ends), or None (other ranks,
        or rank 0 under the local launcher, which holds it).

    Raises:
        RunLocked: on every rank, when a process that is not an ancestor of rank 0 holds the lock.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    lock: Optional[Lock] = None
    refusal = ""
    if rank == 0:
        lock, refusal = _take(run)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = str(shared[0])
    if refusal:
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()  # a group left to interpreter exit aborts the process (SIGABRT)
        raise RunLocked(refusal)
    return lock


def _take(run: RunDir) -> Tuple[Optional[Lock], str]:
    """Rank 0's attempt: (the lock, "") taken; (None, "") held by an ancestor; (None, why) refused."""
    deadline = time.monotonic() + PLANNER_GRACE_S
    while True:
        try:
            return acquire(run.lock, WHAT, subject=f"run directory {run.root}"), ""
        except LockHeld as held:
            if held.holder is not None and held.holder.is_ancestor_of_me():
                return None, ""
            planner = held.holder is None or held.holder.what.startswith("planning")
            if not planner or time.monotonic() > deadline:
                return None, f"refused: {held}"
        time.sleep(0.5)
