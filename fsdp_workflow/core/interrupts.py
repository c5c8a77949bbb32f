"""SIGTERM handled as Ctrl-C, for the commands that cannot checkpoint: prepare and consolidate.

``kill``, ``timeout``, a batch system and a closing terminal send SIGTERM, whose default
action ends a Python process at once: no ``finally``, a temporary output of the model's
size left behind, and an exit status of -15 (shown as 241 by a shell that reads it as a
byte). :func:`sigterm_as_ctrl_c` makes SIGTERM run whatever SIGINT's handler is at that
moment, so every path that cleans up after a Ctrl-C (including one that holds Ctrl-C
off while it renames) cleans up after SIGTERM too; :func:`stopped_by` then gives the
exit code and the words for the signal that came: 143 ``terminated (SIGTERM)`` or 130
``interrupted (Ctrl-C)``.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable, Dict, Optional, Tuple

from fsdp_workflow.core.exit_codes import EXIT_INTERRUPTED, EXIT_TERMINATED

_state: Dict[str, Any] = {"terminated": False, "sigint_ignored_at_start": False}


def _on_sigterm(signum: int, frame: Optional[FrameType]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.SIG_IGN and not _state["sigint_ignored_at_start"]:
        return  # a Ctrl-C is already being handled (its handler now ignores more): let its cleanup finish
    _state["terminated"] = True
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # the command's own Ctrl-C handler: it raises, or holds it off a commit
        return
    # Python's default (KeyboardInterrupt), or Ctrl-C ignored from the start (a job started with
    # `&` by a script): SIGTERM still stops the command, as Ctrl-C would.
    raise KeyboardInterrupt


def sigterm_as_ctrl_c() -> Callable[[], None]:
    """Handle SIGTERM as SIGINT's handler of the moment would handle Ctrl-C.

    Call it from the main thread of a command (elsewhere it does nothing). Later
    SIGTERMs are ignored while the first one's cleanup runs.

    Returns:
        A function that puts back the SIGTERM handler found (for callers in-process, tests);
        after a SIGTERM it leaves SIGTERM ignored: the process is on its way out, and a
        second one must not end it with -15 before it exits with 143.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _state["terminated"] = False
    _state["sigint_ignored_at_start"] = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    previous = signal.signal(signal.SIGTERM, _on_sigterm)

    def restore() -> None:
        if not _state["terminated"]:
            signal.signal(signal.SIGTERM, previous)

    return restore


def stopped_by() -> Tuple[int, str]:
    """For a KeyboardInterrupt being handled: its exit code and what stopped the command.

    Returns:
        ``(143, "terminated (SIGTERM)")`` when SIGTERM raised it, else ``(130, "interrupted (Ctrl-C)")``.
    """
    if _state["terminated"]:
        return EXIT_TERMINATED, "terminated (SIGTERM)"
    return EXIT_INTERRUPTED, "interrupted (Ctrl-C)"
