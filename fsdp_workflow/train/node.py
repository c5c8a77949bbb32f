"""One node's ranks, started from a process that imported the trainer once (``cluster.rank_start``).

Rendered into ``train_node.sh`` in place of ``torchrun`` when ``cluster.rank_start``
resolves to ``preloaded``, with torchrun's own arguments::

    python -m fsdp_workflow.train.node --nnodes=1 --node_rank=0 --master_addr=... \\
        --master_port=... --rdzv_conf=timeout=600 --nproc_per_node=2 --max_restarts=0 \\
        -m fsdp_workflow.train RUN_DIR

Why: under ``torchrun -m`` every rank is a fresh interpreter that imports torch,
``torch.distributed.checkpoint`` (DTensor, sympy), Accelerate and transformers
(its lazy import structure, the dynamo that ``masking_utils`` pulls in) before its
first step: about 6.5 CPU-seconds each on the CI machine, three quarters of what a
short run's rank costs, and N ranks of a node do it at once (from a shared file
system, on a cluster). Here the arguments are parsed by torchrun's own parser and
the ranks run under torchrun's own elastic agent (rendezvous, signals forwarded by
``PET_SIGNALS_TO_HANDLE``, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, failure summary and
exit code); only the start differs. The agent starts the ranks with the
``forkserver`` method, and the server is this launcher's own fork: the launcher
imports :data:`PRELOAD` (it imports torch for the agent anyway), then, before the
agent starts a thread or opens a socket, forks the server, which keeps only its
listening socket and pipe and forks each rank on request, with the signal handlers
a fresh interpreter has. One import of the trainer's modules per node, not one for
the agent and another for a spawned server (about 2.5 CPU-seconds a launch on the
CI machine). On a Python whose forkserver internals this module does not know
(:func:`_fork_server`), the server is multiprocessing's own, spawned with the same
preload. Nothing touches CUDA before the fork, but the start is only chosen on its
own (``auto``) for CPU runs until a GPU run has confirmed it (docs/training.md,
"How the ranks start").

A rank ends as it would under ``torchrun -m``: its exit code is the trainer's, its
output unbuffered (``python -u``), its ``atexit`` functions run.

No orphans (:mod:`fsdp_workflow.core.lifeline`): the forked server gets SIGKILL when the
launcher dies, and each rank when the server that forked it does, so a node launcher
killed with ``kill -9`` takes its ranks along (the server's "alive" pipe alone would not
end it: every rank holds a copy of its write end). The server and the ranks keep the
descriptors the launcher inherited on ``RUN_DIR/.lock``: the local launcher's lock
(:mod:`fsdp_workflow.backends.local`) is then held until the last rank has exited.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import traceback
import warnings
from typing import Any, List, Optional, Sequence, Tuple

TRAINER = "fsdp_workflow.train"
# Imported once before the forkserver forks any rank (what and why: its docstring).
PRELOAD = ["fsdp_workflow.train.node_preload"]
# Sent to the whole group by Slurm, the local launcher and kill -- -PGID: the agent re-sends them to the
# ranks. The forkserver ignores them: it must outlive the ranks, because the agent learns each rank's exit
# code through it (a dead server turns every code into 255). Each rank sets them back (rank_main).
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)
# multiprocessing.forkserver.ForkServer's fields on the Pythons whose server this module forks itself
# (3.10 to 3.12 and 3.13's layout); any other layout (3.14's authenticated server) gets the spawned one.
_FORKSERVER_FIELDS = frozenset({"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid",
                                "_inherited_fds", "_lock", "_preload_modules"})
# The forked server's pid, set in the server itself (:func:`_serve`): each rank it forks inherits it,
# and arms its parent-death signal for exactly that parent. None in the launcher and a spawned server.
_SERVER_PID: Optional[int] = None


def rank_main(run_dir: str) -> None:
    """One rank: ``python -u -m fsdp_workflow.train RUN_DIR``, in a process forked from the preloaded server."""
    # torchrun starts each rank in a session of its own: a terminal's Ctrl-C (or a signal to the
    # launcher's process group) reaches the ranks only as torchrun re-sends it, once.
    os.setsid()
    from fsdp_workflow.train.signals import install_early

    for sig in GROUP_SIGNALS:  # as an exec'd rank has them: torchrun's agent handles each, exec resets it
        signal.signal(sig, signal.SIG_DFL)
    install_early()  # then, as `python -m fsdp_workflow.train` does first: a signal from here on is kept
    _die_with_the_server()
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(write_through=True)  # as `python -u` under torchrun
    try:
        from fsdp_workflow.train.__main__ import main

        code = main([run_dir])
    except SystemExit:
        raise
    except KeyboardInterrupt:
        # multiprocessing would end the rank with 0 for it; an exec'd rank dies of the signal.
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()  # where an exec'd rank's interpreter prints it: the rank's stderr
        raise
    finally:
        # A forked process leaves with os._exit: run what interpreter shutdown would
        # (logging's flush, trackers' closers), as under torchrun's exec'd ranks.
        atexit._run_exitfuncs()
    if code:
        raise SystemExit(code)  # torchrun's agent reports it, as for an exec'd rank


def _die_with_the_server() -> None:
    """SIGKILL when the forkserver dies (with the agent), in place of the SIGINT torch's multiprocessing
    asks for: SIGINT would have the rank checkpoint with no agent left to stop or reap it. An exec'd
    rank asks for the same when its agent dies (``python -m fsdp_workflow.train``). Linux; elsewhere a no-op."""
    from fsdp_workflow.core.lifeline import arm

    arm(signal.SIGKILL, _SERVER_PID if _SERVER_PID is not None else os.getppid())


def _refusal(args) -> Optional[str]:
    if not args.module or args.training_script != TRAINER or len(args.training_script_args) != 1:
        return f"expected torchrun's arguments ending in `-m {TRAINER} RUN_DIR`"
    if args.no_python or args.run_path:
        return "--no-python and --run-path start other programs; use torchrun itself for them"
    return None


def launch_config(argv: Optional[List[str]] = None) -> Tuple[Any, str]:
    """torchrun's ``LaunchConfig`` for ``argv`` (its own parser, ``PET_*`` defaults and all) with the
    forkserver start, and the run directory. Exits 2 for arguments that are not a trainer launch."""
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(argv)
    problem = _refusal(args)
    if problem is not None:
        print(f"python -m fsdp_workflow.train.node: {problem}", file=sys.stderr)
        raise SystemExit(2)
    if args.master_port is None:  # torchrun's default
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    return config, args.training_script_args[0]


def run(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.launcher.api import elastic_launch

    config, run_dir = launch_config(argv)
    try:
        start_server(run_lock_fds(run_dir))  # before the agent's first thread and socket (its rendezvous)
        elastic_launch(config=config, entrypoint=rank_main)(run_dir)
    finally:
        _stop_helpers()


def run_lock_fds(run_dir: str) -> List[int]:
    """This process's descriptors open on ``RUN_DIR/.lock``: the lock the local launcher passed down."""
    from fsdp_workflow.core.rundir import RunDir

    try:
        lock = os.stat(RunDir.of(run_dir).lock)
    except OSError:
        return []
    out = []
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, already closed
            continue
        if (st.st_dev, st.st_ino) == (lock.st_dev, lock.st_ino):
            out.append(int(name))
    return out


def start_server(keep_fds: Sequence[int] = ()) -> None:
    """Start the forkserver the agent's ``start_processes`` will use: forked from here after importing
    :data:`PRELOAD`, or spawned by multiprocessing with it. Either ignores :data:`GROUP_SIGNALS`.

    ``keep_fds``: descriptors the forked server keeps open for the ranks it forks (the run's lock).
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if set(vars(server)) <= _FORKSERVER_FIELDS and server._forkserver_pid is None:
        for name in PRELOAD:
            importlib.import_module(name)
        _fork_server(server, keep_fds)
        return
    multiprocessing.set_forkserver_preload(PRELOAD)
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in GROUP_SIGNALS}  # SIG_IGN survives the exec
    try:
        server.ensure_running()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _fork_server(server: Any, keep_fds: Sequence[int] = ()) -> None:
    """What ``ForkServer.ensure_running`` does, with ``os.fork()`` in place of its exec of a new
    interpreter: the server is this process as it is now, modules imported, before the agent starts
    its threads and opens its sockets. The child keeps stdin/out/err, the listening socket and the read end of the
    "alive" pipe (as the exec'd server does), and serves until the agent closes the write end."""
    from multiprocessing import connection, resource_tracker, util

    with server._lock:
        resource_tracker.ensure_running()
        address = connection.arbitrary_address("AF_UNIX")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            launcher = os.getpid()
            try:
                with warnings.catch_warnings():
                    # Python 3.12+ warns of any fork in a process with threads: here the idle native
                    # threads that importing torch and transformers starts. The child runs only the
                    # server's pure-Python loop, as multiprocessing's server does with them imported.
                    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks",
                                            category=DeprecationWarning)
                    pid = os.fork()
            except BaseException:
                os.close(alive_r)
                os.close(alive_w)
                raise
            if pid == 0:
                _serve(listener.fileno(), alive_r, keep_fds, launcher)  # never returns
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def _serve(listener_fd: int, alive_r: int, keep_fds: Sequence[int] = (), launcher: Optional[int] = None) -> None:
    """The forked server's whole life: multiprocessing's own server loop, then ``os._exit`` (the
    launcher's ``atexit`` functions and ``finally`` blocks are not the server's to run)."""
    global _SERVER_PID
    code = 1
    try:
        if launcher is not None:  # the launcher's main thread forked it, and lives as long as the launcher
            from fsdp_workflow.core.lifeline import arm

            arm(signal.SIGKILL, launcher)
        _SERVER_PID = os.getpid()
        for low, high in _gaps(sorted({0, 1, 2, listener_fd, alive_r, *keep_fds})):
            os.closerange(low, high)
        for sig in GROUP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        from multiprocessing import forkserver

        forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit as err:  # the loop's end: every client closed the "alive" pipe
        code = err.code if isinstance(err.code, int) else 0
    except BaseException:  # noqa: BLE001 - said on stderr, then the server ends like any
        traceback.print_exc()
    finally:
        os._exit(code)


def _gaps(keep: List[int]) -> List[Tuple[int, int]]:
    """The ``[low, high)`` ranges of descriptors between and after ``keep`` (sorted): what to close."""
    out, low = [], 0
    for fd in keep:
        if fd > low:
            out.append((low, fd))
        low = fd + 1
    out.append((low, os.sysconf("SC_OPEN_MAX")))
    return out


def _stop_helpers() -> None:
    """End the forkserver and multiprocessing's resource tracker before this process: torchrun's agent
    leaves nothing behind when it exits, and a scheduler or a test waiting on it may check just that."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop_helper(helper)


def stop_helper(helper: Any) -> None:
    """Stop one of multiprocessing's helper processes (its forkserver, its resource tracker) with
    CPython's own shutdown (closes its pipe, reaps it); a no-op where that is absent or already done."""
    stop = getattr(helper, "_stop", None)
    if stop is not None:
        try:
            stop()
        except (OSError, ChildProcessError):
            pass


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    # As torchrun's main: a failed rank is summarised (its exit code, host, time) and the
    # agent exits 1; the trainer's own code is in RUN_DIR/train_exit.json.
    record(run)(argv)


if __name__ == "__main__":
    from fsdp_workflow.core.fastexit import run_main

    run_main(main)  # as torchrun's main, without tearing down torch's modules (fastexit)
