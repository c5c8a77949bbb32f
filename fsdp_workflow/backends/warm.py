"""A local chain's data, consolidation and model-card steps, forked from one interpreter that imported torch once.

On a cluster these steps are separate Slurm jobs. On this machine the local launcher
(:mod:`fsdp_workflow.backends.local`) runs them one after the other, and each used to be
a fresh ``python -m``: the data step imports transformers for the tokenizer, and the
consolidation's check that transformers loads the result (``from_pretrained``, for
models under 256 MB) imports torch and transformers' modeling code again. That was
about 8 of the 9 CPU-seconds of a small model's consolidation on the CI machine, and
most of a smoke chain's time outside training. Here one helper process imports them
(:data:`PRELOAD`) and each step is a ``fork()`` of it that runs the step exactly as
``python -m MODULE ARGS`` would (``runpy.run_module(..., run_name="__main__")``, its own
session, its ``atexit`` functions, its exit code or the signal that killed it).

What a fork cannot reproduce is the interpreter's start, so the helper is started
with the environment the steps get (the code snapshot first on ``PYTHONPATH``: the
helper and every step import the code as planned), and a step is forked only when
its command is this interpreter's ``python -m`` of one of :data:`MODULES` with that
same environment; anything else (a container runtime's command line) runs as
before, as its own process. A helper that cannot start or dies does the same.

The protocol is JSON lines on a Unix socket pair that only the two hold: a request
``{"module", "args", "cwd"}`` with the launcher's standard input, output and error as
they are at that moment (passed as descriptors, so a step writes where a started one
would), the reply ``{"pid"}`` once the step is in its own session (so a forwarded
signal cannot miss it), then ``{"status"}`` when it ended, as
:func:`os.waitstatus_to_exitcode` gives it (negative: killed by that signal).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from typing import List, Optional, Sequence, Tuple

from fsdp_workflow.core.fastexit import exit_now
from fsdp_workflow.core.lifeline import arm, child_dies_with_me

# The steps that may be forked, and what the helper imports for them: the consolidation's
# from_pretrained check needs torch and transformers' modeling code, the data step the tokenizer.
MODULES = frozenset({"fsdp_workflow.data.prepare", "fsdp_workflow.consolidate", "fsdp_workflow.report.card"})
PRELOAD = ("torch", "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.models.auto.modeling_auto", "transformers.tokenization_utils_base",
           "fsdp_workflow.data.encode", "fsdp_workflow.data.tokenizer", "fsdp_workflow.consolidate.consolidation",
           "fsdp_workflow.consolidate.verify.architecture", "fsdp_workflow.config.record", "matplotlib.figure")


def step_module(argv: Sequence[str]) -> Optional[str]:
    """The module of a ``[sys.executable, "-m", MODULE, ...]`` step this helper may fork, else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in MODULES:
        return argv[2]
    return None


class WarmSteps:
    """The launcher's end of the helper: :meth:`start`, then :meth:`begin` and :meth:`wait` for each step,
    then :meth:`close`."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, env: dict) -> None:
        self._proc = proc
        self._sock = sock
        self._replies = sock.makefile("r")
        self.env = dict(env)

    @classmethod
    def start(cls, env: dict, keep_fds: Sequence[int] = ()) -> Optional["WarmSteps"]:
        """The helper, importing :data:`PRELOAD` in the background; None where it cannot start.

        Args:
            env: the environment of the steps it will fork.
            keep_fds: descriptors the helper and its steps keep open (the run's lock, which they
                then hold with the launcher). The helper gets SIGTERM when the launcher dies, and
                each step when the helper does (:mod:`fsdp_workflow.core.lifeline`).
        """
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], env=env,
                                    stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(), *keep_fds),
                                    start_new_session=True, preexec_fn=child_dies_with_me(signal.SIGTERM))
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(proc, ours, env)

    def begin(self, argv: Sequence[str], env: dict) -> Optional[int]:
        """Fork ``argv`` (a :func:`step_module` command) in the helper: the step's pid, or None (run it yourself)."""
        module = step_module(argv)
        if module is None or env != self.env or self._proc.poll() is not None:
            return None
        request = json.dumps({"module": module, "args": list(argv[3:]), "cwd": os.getcwd()}) + "\n"
        try:
            socket.send_fds(self._sock, [request.encode()], [0, 1, 2])
            reply = self._replies.readline()
        except OSError:
            return None
        if not reply:  # the helper died before forking: nothing of the step ran
            return None
        return int(json.loads(reply)["pid"])

    def wait(self) -> int:
        """The step's exit code as :func:`os.waitstatus_to_exitcode` gives it (255 if the helper died)."""
        reply = self._replies.readline()
        return int(json.loads(reply)["status"]) if reply else 255

    def close(self) -> None:
        for end in (self._replies, self._sock):
            try:
                end.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _run_step(module: str, args: List[str], cwd: str, stdio: List[int], ready_w: int, helper: int) -> None:
    """The forked step: ``python -m MODULE ARGS`` in a session of its own; never returns."""
    import runpy
    import traceback

    code, signum = 1, None
    try:
        os.setsid()  # as the launcher's own children are started: a signal reaches the step's group only
        arm(signal.SIGTERM, helper)  # the helper dies with the launcher; its step with it, as a started one would
        os.write(ready_w, b"1")
        os.close(ready_w)
        for target, fd in enumerate(stdio):  # the launcher's standard streams, as a started step has them
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            code = err.code or 0
        else:
            print(err.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        signum = signal.SIGINT  # a fresh interpreter dies of the signal
    except BaseException:  # noqa: BLE001 - printed where the interpreter prints it
        traceback.print_exc()
    exit_now(code, signum)  # what interpreter shutdown runs for others (threads, atexit, streams), then _exit


def _request(sock: socket.socket) -> Optional[Tuple[dict, List[int]]]:
    """The next request and the descriptors that came with it; None once the launcher closed its end."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    if not data:
        return None
    while not data.endswith(b"\n"):
        more = sock.recv(1 << 16)
        if not more:
            return None
        data += more
    return json.loads(data), list(fds)


def serve(fd: int) -> None:
    """The helper's loop: one step at a time, until the launcher closes its end of the socket."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the step that needs it reports it, as a fresh interpreter would
    sock = socket.socket(fileno=fd)
    while True:
        got = _request(sock)
        if got is None:
            break
        req, stdio = got
        ready_r, ready_w = os.pipe()
        me = os.getpid()
        with warnings.catch_warnings():
            # Python 3.12+ warns of a fork in a process with threads: the idle native threads importing
            # torch starts. The step runs as the node launcher's forked ranks do with them imported.
            warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks",
                                    category=DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            sock.close()
            _run_step(req["module"], req["args"], req["cwd"], stdio, ready_w, me)
        for passed in (ready_w, *stdio):
            os.close(passed)
        os.read(ready_r, 1)  # the step is in its own session (or already gone)
        os.close(ready_r)
        sock.sendall((json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        sock.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    # The launcher is done with it: nothing of the helper's own is left to flush, and tearing down the
    # interpreter with torch imported costs a second or more, which the launcher would wait for.
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
