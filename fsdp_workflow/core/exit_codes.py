"""Process exit codes shared by every stage.

They are a contract between the trainer (which knows nothing of Slurm) and
the rendered job scripts (which decide what to do with each code).
"""

import errno
import signal
from typing import Iterable

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error: a traceback was printed
EXIT_USAGE = 2  # bad config or arguments: a message naming the key was printed, nothing ran
EXIT_NONFINITE = 65  # EX_DATAERR: NaN/inf in the loss or grad norm (last good checkpoint kept) or in weights to consolidate
EXIT_PREFLIGHT = 66  # the training job's preflight found a node that cannot run it (log: the node, the check, the fix)
EXIT_DISK_FULL = 74  # EX_IOERR: a save hit ENOSPC/EDQUOT; the previous checkpoint is intact, free space and resubmit
# The errnos that mean "disk full" (EDQUOT: over a quota), for every stage that writes big files.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
EXIT_REQUEUE = 75  # EX_TEMPFAIL: preempted or out of time, a checkpoint was saved; requeue me
EXIT_PEER_TIMEOUT = 76  # EX_PROTOCOL: a collective timed out (cluster.rdzv_timeout_s): another rank stopped answering
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped by Ctrl-C where nothing can be checkpointed (consolidation: no partial output)
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: stopped by SIGTERM (kill, timeout, a scheduler) where nothing can be checkpointed
# torchrun reports any failed worker as 1, so the job scripts requeue on the run directory's
# marker (fsdp_workflow.core.rundir.REQUEUE_MARKER) rather than on this code alone.

#: What each code means, for ``status`` and the job logs.
MEANINGS = {
    EXIT_OK: "finished",
    EXIT_FAILURE: "failed (see the traceback in the log)",
    EXIT_USAGE: "refused: bad config or arguments",
    EXIT_NONFINITE: "non-finite values: the loss or gradient norm became NaN/inf (the last good checkpoint is kept), or consolidation found NaN/inf weights",
    EXIT_PREFLIGHT: "preflight failed: a node of the allocation cannot run the training (the log names the node, the check and the fix); nothing was trained",
    EXIT_DISK_FULL: "disk full during a save; the previous checkpoint is intact",
    EXIT_REQUEUE: "preempted after a checkpoint; requeue",
    EXIT_PEER_TIMEOUT: "a rank stopped answering; a collective timed out",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); nothing partial was left",
    EXIT_TERMINATED: "terminated (SIGTERM); nothing partial was left",
}

#: A sweep point that ends with one of these was stopped by a signal sent to the sweep's own
#: command (Ctrl-C, SIGTERM, SIGUSR2): the sweep stops there instead of running the next point.
SWEEP_STOPPING = frozenset({EXIT_REQUEUE, EXIT_INTERRUPTED, EXIT_TERMINATED})


def worst(codes: Iterable[int]) -> int:
    """The exit code of several runs (a sweep's points): 0 when every one finished, else the worst.

    The worst is the highest code, except that a preemption that saved a checkpoint
    (75, the run resumes) counts below any failure.

    Args:
        codes: each run's exit code.

    Returns:
        The code the command that ran them all exits with.
    """
    failed = [c for c in codes if c != EXIT_OK]
    return max(failed, key=lambda c: (c != EXIT_REQUEUE, c)) if failed else EXIT_OK
