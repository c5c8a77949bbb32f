"""Right after submitting: read each job's pending reason; a chain Slurm will never start is cancelled.

The checks before submitting (:mod:`fsdp_workflow.backends.slurm.cluster_check`) read
what they can; a limit they do not read (a QoS's MaxTRESPerJob, a partition
changed meanwhile, ``cluster.check_limits=false``) still shows up as a pending
reason at the first scheduling pass. :func:`watch` polls ``squeue`` for a few
seconds; the first reason that means "never" (:mod:`fsdp_workflow.backends.slurm.reasons`)
cancels every job of the chain and waits until none is left in the queue.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.backends.slurm.cluster_check import option_key
from fsdp_workflow.backends.slurm.reasons import POLL_S, WATCH_S, Reason, explain
from fsdp_workflow.backends.slurm.queue import JobState, QueuedJob, SlurmQueue, SlurmUnreachable
from fsdp_workflow.plan.jobs import NOUN, SbatchJob

GONE_S = 15.0  # how long to wait for cancelled jobs to leave squeue

# Which option a "never" reason is about, to name the key a user changes.
_OPTION = {"PartitionTimeLimit": "time", "QOSMaxWallDurationPerJobLimit": "time",
           "AssocMaxWallDurationPerJobLimit": "time", "PartitionNodeLimit": "nodes", "BadConstraints": "constraint",
           "InvalidAccount": "account", "AccountNotAllowed": "account", "InvalidQOS": "qos", "QOSNotAllowed": "qos"}


@dataclass(frozen=True)
class Stuck:
    """A job Slurm will never start: which, and why."""

    job: SbatchJob
    job_id: str
    reason: Reason


def read_queue(job_ids: Sequence[str]) -> Optional[Dict[str, QueuedJob]]:
    """The jobs squeue still lists, by id; None when squeue does not answer."""
    try:
        return SlurmQueue().squeue(job_ids)
    except SlurmUnreachable:
        return None


def watch(jobs: Sequence[Tuple[SbatchJob, str]], seconds: float = WATCH_S) -> List[Stuck]:
    """Poll the jobs' pending reasons until each has one, or ``seconds`` pass.

    A job refused at submission's immediate scheduling attempt first shows a
    coarse reason (PartitionConfig) that the next scheduling pass makes precise
    (PartitionTimeLimit): once a "never" shows, the poll runs to the end so the
    message carries the precise one. A chain that fits returns as soon as every
    job has a reason.

    Args:
        jobs: (job, id) for each job of the chain as submitted.
        seconds: the longest wait.

    Returns:
        The jobs whose latest reason means "never" (empty: nothing is known to be stuck).
    """
    ids = {job_id: job for job, job_id in jobs}
    deadline = time.monotonic() + seconds
    stuck: List[Stuck] = []
    while True:
        queue = read_queue(list(ids))
        if queue is None:
            return stuck
        stuck = [Stuck(ids[i], i, explain(q.reason)) for i, q in queue.items()
                 if q.state is JobState.PENDING and i in ids and explain(q.reason).never]
        settled = all(q.state is not JobState.PENDING or q.reason not in ("None", "") for q in queue.values())
        if (settled and not stuck) or time.monotonic() >= deadline:
            return stuck
        time.sleep(POLL_S)


def cancel_and_wait(job_ids: Sequence[str]) -> List[str]:
    """``scancel`` every job, then wait until squeue lists none; return the ids still listed after ``GONE_S``."""
    subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + GONE_S
    while True:
        queue = read_queue(job_ids)
        left = [i for i, q in (queue or {}).items() if not q.state.ended]
        if (queue is not None and not left) or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def issues(cfg: WorkflowConfig, stuck: Sequence[Stuck]) -> List[Issue]:
    """The stuck jobs as config issues, one per (key, reason): the key to change, the reason in words, the fix."""
    grouped: Dict[Tuple[str, str], List[Stuck]] = {}
    values: Dict[str, object] = {}
    for s in stuck:
        key, value = option_key(cfg, s.job, _OPTION.get(s.reason.code.split(",")[0], "partition"))
        values[key] = value
        grouped.setdefault((key, s.reason.code), []).append(s)
    out = []
    for (key, code), group in grouped.items():
        jobs = ", ".join(f"{NOUN[s.job.role]} job {s.job_id}" for s in group)
        reason = group[0].reason
        out.append(Issue(key, values[key], f"Slurm keeps the {jobs} PENDING ({code}): {reason.words}; "
                                           "it would never start", reason.fix))
    return out
