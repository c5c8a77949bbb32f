"""Preemption: turn SIGUSR2 / SIGTERM / SIGINT into "finish the step, checkpoint, exit 75".

Slurm sends SIGUSR2 ``signal_delay_s`` before the time limit (``--signal``) and
SIGTERM on preemption or ``scancel``. A handler only records the signal; the
training loop checks the flag once per optimizer step, agrees on it across all
ranks (an all-reduce folded into the loss reduction, so a signal that reached
only some ranks still stops all of them at the same step), saves a blocking
checkpoint and exits with :data:`fsdp_workflow.core.exit_codes.EXIT_REQUEUE`.

Which process must receive the signal: every rank handles it, so it may be sent
to the ranks directly (``scancel --signal=USR2 --full`` or ``--signal=USR2@T``
without ``B:``), or to ``torchrun`` when torchrun is told to forward it:
``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2``, or its variable
``PET_SIGNALS_TO_HANDLE`` (what the generated ``train_node.sh`` exports), makes
the elastic agent re-send the signal it got to every worker and wait
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) before SIGKILL.
``TORCHELASTIC_SIGNALS_TO_HANDLE`` does nothing: torchrun overwrites it. Without
SIGUSR2 in the list, SIGUSR2 kills torchrun at once (or is ignored, if inherited
so) and never reaches the ranks, which torchrun starts in sessions of their own.

SIGINT (Ctrl-C in a local run, forwarded by the launcher and torchrun) is a
preemption too: the step finishes, a checkpoint is saved, exit 75, and the same
command resumes. A second SIGINT means "stop now": the rank leaves at once with
:data:`~fsdp_workflow.core.exit_codes.EXIT_INTERRUPTED` and one line, never a
``KeyboardInterrupt`` traceback. A save it cuts short stays in ``step-N.tmp``,
which is never taken for a checkpoint, so the last committed one is what resumes.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Optional

from fsdp_workflow.core.exit_codes import EXIT_INTERRUPTED

HANDLED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


_early_signum: Optional[int] = None  # a signal that came before the training loop's flag was installed


def _stop_now() -> None:
    """The user asked twice: no checkpoint, no traceback; one write, as ranks share the terminal."""
    rank = os.environ.get("RANK", "0")
    os.write(sys.stderr.fileno(), f"[fsdp_workflow] rank {rank}: interrupted again; stopping at once "
             "(the last committed checkpoint is kept)\n".encode())
    os._exit(EXIT_INTERRUPTED)


def install_early() -> None:
    """Record SIGUSR2/SIGTERM/SIGINT from the rank's first moment, before torch is even imported.

    A Ctrl-C while the ranks still import and build the model would otherwise be a
    ``KeyboardInterrupt`` traceback per rank; recorded here, it is handed to the
    :class:`PreemptionFlag` the loop installs, and the run stops after its first step.
    """
    def handle(signum: int, frame: Optional[FrameType]) -> None:
        global _early_signum
        if _early_signum is None:
            _early_signum = signum
        elif signum == signal.SIGINT:
            _stop_now()

    for sig in HANDLED:
        signal.signal(sig, handle)


class PreemptionFlag:
    """Records the first of SIGUSR2/SIGTERM/SIGINT received; install once per rank, in the main thread.

    A second SIGINT ends the process at once (see the module docstring).
    """

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "PreemptionFlag":
        if self.signum is None:
            self.signum = _early_signum
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is None:
            self.signum = signum
        elif signum == signal.SIGINT:
            _stop_now()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""
