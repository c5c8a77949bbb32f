"""A process of a run dies with the process that started it: Linux's parent-death signal.

``kill -9`` of ``python -m fsdp_workflow`` (or a closed terminal's SIGHUP, or the OOM
killer) used to leave the node launcher and its ranks running under init, still
training and checkpointing into a run directory whose lock had gone with the command,
and still holding their GPUs. Each process the run starts now asks the kernel for a
signal when its parent dies, ``prctl(PR_SET_PDEATHSIG)``:

- the command's children (the node script, the data, consolidation and model-card
  steps, the helper that forks them) get SIGTERM: the node launcher's torchrun agent
  forwards it to the ranks, which finish their step, checkpoint and exit 75, and kills
  them after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; a consolidation removes its partial
  output (:mod:`fsdp_workflow.backends.local`);
- each rank gets SIGKILL when its own parent (the agent, or the forkserver that forked
  it) dies: that agent was what would have stopped and reaped it.

Two details of the kernel's rule decide where this is called. The signal follows the
death of the parent *thread* that forked the process, so it is armed in the child, for a
parent whose forking thread waits for it (the launcher's main thread, the forkserver's
only thread). And a parent may die before the child asks, so after arming, the child
compares ``getppid()`` with the parent it expects and, if that one is already gone, sends
itself the signal it would have had. The signal survives ``execve``, except into a
set-user-ID program (a setuid container starter): there it is lost, and what stands
between the ranks and orphanhood is the agent's own stop.

Linux only; elsewhere :func:`arm` does nothing and says so. Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_prctl: Optional[Callable[..., int]] = None


def _load() -> Optional[Callable[..., int]]:
    """libc's ``prctl``, resolved once (before any fork: a child must not ``dlopen``)."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = None
    return _prctl


def arm(signum: int, parent: int) -> bool:
    """Have the kernel send ``signum`` to this process when ``parent`` (its parent now) dies.

    Args:
        signum: the signal to get (SIGTERM to stop cleanly, SIGKILL to stop at once).
        parent: the pid of the process that started this one, as it knew it before the
            fork; if it is no longer this process's parent, it died before the signal was
            armed, and this process sends itself ``signum`` now.

    Returns:
        True when armed (Linux), False where the platform has no parent-death signal.
    """
    prctl = _load()
    if prctl is None:
        return False
    if prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # died before we asked: the kernel will never send it
        os.kill(os.getpid(), signum)
    return True


def disarm() -> None:
    """Clear the parent-death signal (torch's multiprocessing arms SIGINT in every child it starts)."""
    prctl = _load()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)


def child_dies_with_me(signum: int) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``signum`` when this process dies.

    Call it in the thread that starts the child and waits for it (the signal follows the
    death of the forking thread). ``prctl`` is resolved here, in the parent, so the child
    only calls it between ``fork`` and ``exec``.
    """
    me = os.getpid()
    _load()

    def preexec() -> None:
        arm(signum, me)

    return preexec
