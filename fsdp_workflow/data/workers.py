"""Ordered fork workers for prepare: one pipe per worker, nothing shared.

Why not ``multiprocessing.Pool``: its workers read tasks from one queue guarded by a
shared semaphore, and an idle worker blocks in ``recv`` *holding* it. SIGTERM sent to
the process group (``kill -- -PGID``, the local launcher forwarding ``kill``, a
scheduler) kills such a worker with the semaphore taken, and ``Pool.terminate`` then
waits for it forever (``_help_stuff_finish``): a prepare that ignores SIGTERM, seen in
CI as a 120 s hang. Here each worker owns its pipe, ignores SIGINT and SIGTERM (the
parent alone reports an interrupt, once), and the parent ends every worker with
SIGKILL on the way out, whatever the reason. A worker that dies on its own (the
kernel's OOM killer) is named with its exit code instead of hanging the parent.

Chunk ``i`` goes to worker ``i % N``; each worker answers its chunks in the order
received, so reading worker ``i % N`` for result ``i`` gives the results in order.

Each worker reads its pipe in a thread of its own, into a local queue, while its main
thread encodes and answers. Without that, a chunk and a result each larger than the
socket buffer (about 200 kB; a 512-record chunk of chat is about 1 MB) deadlock: the
parent blocks sending chunk ``i + N`` to a worker that blocks sending result ``i``,
which the parent reads only after its send returns. The parent keeps at most
``IN_FLIGHT_PER_WORKER`` chunks per worker in flight, so the queue stays that short.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Deque, Iterable, Iterator, List, Tuple

IN_FLIGHT_PER_WORKER = 2


class WorkerDied(RuntimeError):
    """A tokenising worker ended without answering (killed, out of memory)."""


_CLOSED = object()  # the parent closed the pipe (or is gone)


def _serve(conn: Connection, fn: Callable[[Any], Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports Ctrl-C and ends us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # likewise kill/timeout sent to the whole group
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()

    def read() -> None:  # drains the pipe while the main thread works or waits to answer (see the docstring)
        while True:
            try:
                inbox.put((True, conn.recv()))
            except (EOFError, OSError):
                inbox.put(_CLOSED)
                return
            except BaseException as err:  # noqa: BLE001 - an item that cannot be unpickled: answered as its error
                inbox.put((False, err))

    threading.Thread(target=read, daemon=True).start()
    while True:
        got = inbox.get()
        if got is _CLOSED:  # the parent is gone
            os._exit(0)
        try:
            read_ok, item = got
            if not read_ok:
                raise item
            conn.send((True, fn(item)))
        except BaseException as err:  # noqa: BLE001 - re-raised in the parent, as Pool did
            try:
                conn.send((False, err))
            except Exception:  # noqa: BLE001 - an unpicklable error: say what it was
                conn.send((False, RuntimeError(f"{type(err).__name__}: {err}")))


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> Iterator[Any]:
    """``map(fn, items)`` over ``workers`` forked processes, results in input order.

    Forked, so the workers inherit what the parent set up (the tokenizer, the compiled
    template). An exception raised by ``fn`` is raised here, for its item.
    """
    ctx = multiprocessing.get_context("fork")
    procs: List[Tuple[Any, Connection]] = []
    try:
        for _ in range(workers):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_serve, args=(child, fn), daemon=True)
            p.start()
            child.close()
            procs.append((p, parent))
        pending: Deque[int] = collections.deque()  # worker index of each item in flight, in input order
        sent = 0

        def take() -> Any:
            w = pending.popleft()
            p, conn = procs[w]
            try:
                ok, value = conn.recv()
            except (EOFError, OSError):
                p.join(timeout=5)
                raise WorkerDied(f"tokenising worker {w} (pid {p.pid}) ended without an answer, exit code "
                                 f"{p.exitcode} (a negative code is the signal that killed it; -9 is often the "
                                 "kernel's out-of-memory killer: lower data.num_workers)") from None
            if not ok:
                raise value
            return value

        for item in items:
            procs[sent % workers][1].send(item)
            pending.append(sent % workers)
            sent += 1
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield take()
        while pending:
            yield take()
    finally:
        for p, conn in procs:
            if p.exitcode is None:
                p.kill()
            conn.close()
        for p, _ in procs:
            p.join()
