"""Which failures the trainer turns into a named exit instead of a traceback.

Two faults burn the most GPU time when they are reported as "exit code 1":

* **A full disk during a save** (ENOSPC, or EDQUOT on quota'd filesystems). The
  save fails in ``step-N.tmp``, which is never renamed, so the previous
  checkpoint is intact; the trainer removes the partial directory (freeing the
  space it took), exits :data:`~fsdp_workflow.core.exit_codes.EXIT_DISK_FULL`
  and says which path filled.
* **A collective that timed out** (``cluster.rdzv_timeout_s``): some rank
  stopped answering. The trainer exits
  :data:`~fsdp_workflow.core.exit_codes.EXIT_PEER_TIMEOUT` and names the rank
  and host from the heartbeats (:mod:`.heartbeat`).

After a **divergence** (the loss or gradient norm NaN/inf, exit 65),
:func:`after_divergence` says which checkpoint to resume from, and with what.

DCP reports a failure on any rank to every rank as a ``CheckpointException``
(a ``BaseException``) holding each rank's exception, so :func:`causes` walks
those as well as ``__cause__`` / ``__context__``.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Iterator, Optional, Tuple

from fsdp_workflow.config.record import open_run
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.commands import hydra_value, shell
from fsdp_workflow.core.exit_codes import DISK_FULL_ERRNOS, EXIT_PEER_TIMEOUT
from fsdp_workflow.core.rundir import RunDir, step_name

DIST_ERRORS = ("DistBackendError", "DistStoreError", "DistNetworkError")
# gloo: "Timed out waiting 600000ms for recv operation to complete"; NCCL's watchdog:
# "Watchdog caught collective operation timeout"; c10d store: "Socket Timeout" / "timed out".
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it: chained causes and DCP's per-rank failures."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(v[0] for v in failures.values()
                        if isinstance(v, tuple) and v and isinstance(v[0], BaseException))


def disk_full(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC/EDQUOT ``OSError`` behind ``exc``, if any."""
    return next((e for e in causes(exc) if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS), None)


# torch.save's zip writer turns a short write into "[enforce fail at inline_container.cc] unexpected
# pos N vs M" and drops the errno; a filesystem this close to full explains such a failure.
LOW_SPACE_BYTES = 16 * 2**20
LOW_SPACE_FRACTION = 0.005


def disk_full_detail(exc: BaseException, path: Path) -> Optional[str]:
    """Why a failed save into ``path`` is a full disk, or None when it is not one.

    Either an ENOSPC/EDQUOT ``OSError`` is behind ``exc``, or the filesystem holding
    ``path`` is (nearly) full now: torch's zip writer reports a short write without
    its errno, so the free space is the evidence left.
    """
    full = disk_full(exc)
    if full is not None:
        return describe_os_error(full)
    try:
        st = os.statvfs(path if path.exists() else path.parent)
    except OSError:
        return None
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if free < max(LOW_SPACE_BYTES, LOW_SPACE_FRACTION * total):
        first = str(exc).strip().splitlines()
        return (f"[Errno {errno.ENOSPC}] No space left on device: '{path}' (its filesystem has {free} of {total} "
                f"bytes free; torch reported {type(exc).__name__}: {first[-1] if first else ''})")
    return None


def collective_timeout(exc: BaseException) -> Optional[BaseException]:
    """The distributed-backend timeout behind ``exc``, if any (gloo, NCCL or the store)."""
    for e in causes(exc):
        name = type(e).__name__
        backend = isinstance(e, (TimeoutError, RuntimeError)) or name in DIST_ERRORS
        if backend and _TIMEOUT.search(f"{name} {e}"):
            return e
    return None


def describe_os_error(e: OSError) -> str:
    """``[Errno 28] No space left on device: '/path'`` (with the path even when torch dropped it)."""
    where = f": '{e.filename}'" if e.filename else ""
    return f"[Errno {e.errno}] {e.strerror or errno.errorcode.get(e.errno or 0, '')}{where}"


def usage_errors() -> Tuple[type, ...]:
    """The errors the trainer reports as a usage error: one line, exit 2, and ``train_exit.json`` saying why.

    A config the trainer cannot apply (a resume onto another optimizer or model shape, a
    strategy or mesh that does not fit the ranks launched), missing data or checkpoints.
    """
    from fsdp_workflow.train.checkpoint import CheckpointError
    from fsdp_workflow.train.data import DataError
    from fsdp_workflow.train.loss import LossConfigError
    from fsdp_workflow.train.optim import OptimizerError
    from fsdp_workflow.train.parallel import StrategyError
    from fsdp_workflow.train.resume import ResumeError

    return (StrategyError, DataError, OptimizerError, CheckpointError, LossConfigError, ResumeError, FileNotFoundError)


def peer_timeout_reported(run_dir: Path, since: float) -> bool:
    """Whether another rank already wrote a peer-timeout ``train_exit.json`` in this attempt.

    The first rank to time out is the one that really waited; its report stands. A
    stopped rank that Slurm resumes (it sends SIGCONT with the SIGTERM that ends a
    failed step) finds its own deadline long past and times out at once, while the
    peer that just exited still looks alive in the heartbeats: its report would name
    no one and must not replace the one that does.

    Args:
        run_dir: the run directory; its record (:meth:`RunRecord.train_exit_since`) reads
            ``train_exit.json``, the one reader of that file.
        since: when this attempt's process started (``time.time()``); older records are
            an earlier attempt's.
    """
    rec = open_run(run_dir).train_exit_since(since)
    return rec is not None and rec.get("exit_code") == EXIT_PEER_TIMEOUT


def after_divergence(run: RunDir, step: int, cfg: WorkflowConfig) -> str:
    """What to do after the loss or gradient norm of ``step`` became NaN/inf: which checkpoint, which keys.

    The weights that gave the NaN are those of ``step - 1``: a checkpoint of that step
    holds them, whatever learning rate the resume uses. The newest checkpoint at most
    ``step - 2`` is the last whose weights trained to a finite loss and gradient. The
    override named is a path inside the run, the one kind of ``checkpoint.resume``
    that continues a run under a changed config (``auto`` would refuse it, and would
    take the newest).
    """
    last = [(n, p) for n, p in run.list_checkpoints() if n <= step - 2]
    lower = ("Lower optimizer.lr" + ("" if cfg.optimizer.max_grad_norm is not None
                                     else " or set optimizer.max_grad_norm (clipping is off)"))
    newest = run.latest_checkpoint()
    suspect = (f" ({step_name(newest[0])} holds the weights that gave it)"
               if newest is not None and newest[0] == step - 1 else "")
    if not last:
        return (f"No checkpoint before the divergence is kept{suspect}: {lower} and train again from the start, "
                f"in a new run_dir (this one's config.yaml records the diverging run)")
    n, path = last[-1]
    return (f"The last good checkpoint is {step_name(n)}{suspect}. {lower}, then resume from it with "
            f"{shell([f'checkpoint.resume={hydra_value(str(path))}'])}: the learning-rate schedule is the "
            "config's from the first resumed step")
