"""End a command that imported torch without the interpreter's teardown of its modules.

A process that imported torch and transformers spends about 1.4 CPU-seconds (the CI
machine, 2 cores: 8.96 against 7.58 for ``import fsdp_workflow.train.node_preload``,
the mean of four runs each) freeing its modules one by one at exit, after its work is
done and its files are closed. The node launcher, the consolidation, the evaluation
and the data step end through :func:`run_main` instead: what shutdown would run that
matters to anyone else (non-daemon threads joined, ``atexit`` functions such as
logging's flush, the standard streams flushed) runs, then :func:`os._exit` with the
command's code. An exception that escapes ``main`` is left to the interpreter, which
prints it and exits as it always did.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable, NoReturn, Optional


def exit_now(code: int, signum: Optional[int] = None) -> NoReturn:
    """What interpreter shutdown runs for others (threads, ``atexit``, streams), then ``os._exit(code)``.

    With ``signum``, the process then dies of that signal instead, as a fresh interpreter does after
    an unhandled ``KeyboardInterrupt`` (its parent sees SIGINT, not an exit code).
    """
    shutdown = getattr(threading, "_shutdown", None)  # joins non-daemon threads, as Py_Finalize does first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code & 0xFF)


def run_main(main: Callable[[], Optional[int]]) -> NoReturn:
    """``raise SystemExit(main())`` for a ``__main__`` block, ending through :func:`exit_now`.

    A ``SystemExit`` with a message (not a code) is re-raised, so the interpreter prints it as usual.
    """
    try:
        code = main()
    except SystemExit as err:
        if not (err.code is None or isinstance(err.code, int)):
            raise
        code = err.code
    exit_now(code or 0)
