"""Which rank stopped answering: per-rank heartbeats, read when a collective times out.

A rank that hangs without dying (a stopped process, a stuck filesystem, a GPU
that stopped making progress) leaves the others waiting inside a collective
until ``cluster.rdzv_timeout_s`` runs out. The backend's error then says only
"Timed out waiting 600000ms for recv operation" (gloo) or which collective
timed out (NCCL): not who is missing. So every rank keeps a small file,
``RUN_DIR/heartbeats/rank-R.json``: its host, pid, the step and phase the
training loop last announced, and a beat counter, rewritten by a daemon thread
every :func:`beat_interval` seconds. A rank that catches the timeout reads them
all (:func:`who_stopped`) and names the ranks whose beat went stale (a stopped
process beats no more) or that are in a different step or phase from the rest
(a rank stuck in a save while the others wait in the next step's all-reduce).

The cost is one small file write per rank every few seconds (at most every
30 s on long timeouts) and an attribute assignment per phase change.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from fsdp_workflow.core.rundir import RunDir, atomic_write_text


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats: a tenth of the collective timeout, between 1 and 30."""
    return max(1.0, min(30.0, timeout_s / 10.0))


class Heartbeat(threading.Thread):
    """This rank's heartbeat file, rewritten by a daemon thread; the loop sets :attr:`phase`.

    Args:
        run: the run directory.
        rank: global rank.
        interval_s: seconds between beats.
    """

    def __init__(self, run: RunDir, rank: int, interval_s: float) -> None:
        super().__init__(daemon=True, name="heartbeat")
        self.path = run.heartbeat(rank)
        self.rank = rank
        self.interval_s = interval_s
        self.phase = "starting"
        self.step = 0  # the last completed optimizer step, set by the loop
        self.host = socket.gethostname()
        self._beats = 0
        self._stop = threading.Event()

    def start(self) -> "Heartbeat":  # type: ignore[override]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        super().start()
        return self

    def run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def stop(self) -> None:
        self._stop.set()

    def _write(self) -> None:
        self._beats += 1
        record = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "phase": self.phase, "step": self.step,
                  "beats": self._beats, "time": time.time(), "interval_s": self.interval_s}
        try:
            atomic_write_text(self.path, json.dumps(record))
        except OSError:
            pass  # a full or flaky filesystem must not kill training; the next beat retries


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


STALE_BEATS = 3  # a beat older than this many intervals is stale
DEFAULT_INTERVAL_S = 10.0  # a record without its interval_s


def is_stale(rec: dict[str, Any], now: float) -> bool:
    """Whether a heartbeat record's last beat is older than :data:`STALE_BEATS` of its intervals.

    The one rule: the hang detector here and ``status``'s liveness
    (:mod:`fsdp_workflow.report.status.liveness`) both ask it.
    """
    return now - float(rec.get("time", 0.0)) > STALE_BEATS * float(rec.get("interval_s", DEFAULT_INTERVAL_S))


def who_stopped(run: RunDir, world: int, me: int, now: Optional[float] = None) -> str:
    """A sentence naming the ranks (and hosts) that stopped answering, read from the heartbeats.

    Args:
        run: the run directory.
        world: the number of ranks.
        me: the rank asking (its own heartbeat is alive by definition).
        now: the current time (tests); ``time.time()`` by default. Hosts' clocks are
            compared, so a skew of more than a few seconds blurs the ages (NTP keeps
            cluster nodes well inside that).

    Returns:
        E.g. ``"rank 1 on n2 (pid 4242) stopped answering: last heartbeat 21 s ago (it was then in 'step 6')"``;
        or a sentence saying the heartbeats do not single anyone out.
    """
    now = time.time() if now is None else now
    records = {r: _read(run.heartbeat(r)) for r in range(world)}
    missing = [r for r, rec in records.items() if rec is None]
    present = {r: rec for r, rec in records.items() if rec is not None}
    phases = Counter(rec.get("phase") for r, rec in present.items())
    common = phases.most_common(1)[0][0] if phases else None
    blamed: list[str] = []
    for r, rec in sorted(present.items()):
        if r == me:
            continue
        age = now - float(rec.get("time", 0.0))
        stale = is_stale(rec, now)
        odd = len(phases) > 1 and rec.get("phase") != common
        if stale:
            blamed.append(f"rank {r} on {rec.get('host')} (pid {rec.get('pid')}) stopped answering: last heartbeat "
                          f"{age:.0f} s ago (it was then in '{rec.get('phase')}')")
        elif odd:
            blamed.append(f"rank {r} on {rec.get('host')} (pid {rec.get('pid')}) is still beating but stuck in "
                          f"'{rec.get('phase')}' while the others are in '{common}'")
    if missing:
        blamed.append(f"rank(s) {missing} never wrote a heartbeat under {run.heartbeats}")
    if not blamed:
        return (f"the heartbeats under {run.heartbeats} single out no rank (all beating, all in '{common}'): "
                "the wait may be in the network or the collective library")
    return "; ".join(blamed)


def kill_stopped_local_peers(run: RunDir, world: int, me: int) -> list[int]:
    """SIGKILL the ranks on this host whose heartbeat went stale (stopped processes), so the job ends now.

    torchrun would send a stopped worker SIGTERM (which waits until the process is
    continued) and SIGKILL it only after its own 30-second grace; the job is failing
    anyway. Only this training run's own processes are touched: the pid must be
    alive, on this host, and running ``fsdp_workflow.train``.

    Returns:
        The pids killed.
    """
    host, now, killed = socket.gethostname(), time.time(), []
    for r in range(world):
        rec = _read(run.heartbeat(r))
        if r == me or rec is None or rec.get("host") != host or not is_stale(rec, now):
            continue
        pid = int(rec.get("pid", 0))
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid > 1 and b"fsdp_workflow.train" in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed
