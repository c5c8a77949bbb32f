"""Whether a run's processes are alive: the run lock, the heartbeats, the pids on this host.

A local run leaves no scheduler to ask. Its metrics stop growing when it dies, but
metrics alone cannot tell a slow step from a dead run, so ``status`` would draw an ETA
for a run that was Ctrl-C'd an hour ago. Three signs tell instead:

- ``RUN_DIR/.lock`` (:mod:`fsdp_workflow.core.lock`): held by the planner, the local
  launcher and rank 0 while they work; the kernel frees it when its holder dies, so a
  held lock is a live process.
- ``RUN_DIR/heartbeats/rank-R.json``: each rank's host, pid and the time of its last
  beat (rewritten every ``interval_s``). A beat older than three intervals is stale,
  by the trainer's own hang detector's rule (:func:`fsdp_workflow.train.heartbeat.is_stale`).
- the pid of each heartbeat on this host: ``kill(pid, 0)`` says whether it exists (a
  zombie is dead). A fresh beat whose pid is gone is a rank that died a moment ago.

A run is ``running`` when the lock is held or some rank is alive (on this host: its
pid exists and its beat is fresh; on another host: its beat is fresh), ``finished``
when ``train_exit.json`` says 0, ``stopped`` when it once ran (heartbeats, metrics or
an exit record) and nothing is alive, else ``not started``. Slurm runs take their
state from their jobs instead (:func:`slurm_state`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import List, Optional

from fsdp_workflow.core.lock import holder_words, is_locked, read_holder
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.train.heartbeat import is_stale


@dataclass
class Liveness:
    """What ``status`` says about the run's processes."""

    state: str  # running, queued, stopped, finished, not started, unknown
    detail: str = ""  # why: who holds the lock, which pids are gone
    ranks: List[dict] = field(default_factory=list)  # per heartbeat: rank, host, pid, age_s, alive (None: other host)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"  # the state follows the command name
    except (OSError, IndexError):
        return True


def read_heartbeats(run: RunDir, problems: List[str], now: Optional[float] = None) -> List[dict]:
    """Every ``rank-R.json`` as ``{rank, host, pid, phase, step, age_s, stale, alive}``, by rank.

    A file that is not a heartbeat record is appended to ``problems`` (path and why), not skipped
    in silence. ``alive`` is the pid's fate on this host (True/False) and None for another host.
    """
    now = time.time() if now is None else now
    me = socket.gethostname()
    out: List[dict] = []
    if not run.heartbeats.is_dir():
        return out
    for path in sorted(run.heartbeats.glob("rank-*.json")):
        try:
            rec = json.loads(path.read_text())
        except OSError as err:
            problems.append(f"{path}: unreadable: {err.strerror or err}")
            continue
        except ValueError as err:
            problems.append(f"{path}: not JSON ({err})")
            continue
        try:
            rank, host, pid = int(rec["rank"]), str(rec["host"]), int(rec["pid"])
            age = now - float(rec["time"])
            stale = is_stale(rec, now)
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"{path}: not a heartbeat record (needs rank, host, pid, time): {err!r}")
            continue
        alive = pid_alive(pid) if host == me else None
        out.append({"rank": rank, "host": host, "pid": pid, "phase": rec.get("phase"), "step": rec.get("step"),
                    "age_s": round(age, 1), "stale": stale, "alive": alive})
    return sorted(out, key=lambda r: r["rank"])


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def local_liveness(run: RunDir, beats: List[dict], ran: bool, exit_code: Optional[int]) -> Liveness:
    """The state of a run started on this machine (no Slurm job recorded).

    Args:
        run: the run directory.
        beats: from :func:`read_heartbeats`.
        ran: whether it ever trained (metrics or an exit record).
        exit_code: ``train_exit.json``'s code, if any.
    """
    if is_locked(run.lock):
        holder = read_holder(run.lock)
        # A killed command's node launcher and ranks hold its lock until they are gone: name them.
        who = holder_words(run.lock, holder) if holder else "a process that has not written its name yet"
        return Liveness("running", f"{who} holds {run.lock}", beats)
    alive = [b for b in beats if not b["stale"] and b["alive"] is not False]
    if alive:
        where = ", ".join(f"rank {b['rank']} on {b['host']} (pid {b['pid']}, last beat {_ago(b['age_s'])} ago)"
                          for b in alive)
        return Liveness("running", where, beats)
    if exit_code == 0:
        return Liveness("finished", "train_exit.json records exit code 0", beats)
    if not beats and not ran and exit_code is None:
        return Liveness("not started", "no heartbeat, metric or exit record yet", beats)
    gone = [f"rank {b['rank']} pid {b['pid']} on {b['host']} "
            + ("gone" if b["alive"] is False else "silent") + f", last beat {_ago(b['age_s'])} ago" for b in beats]
    why = "no process of this run is alive: the run lock is free" + ("; " + "; ".join(gone) if gone else "")
    return Liveness("stopped", why, beats)


def slurm_liveness(statuses: List[str], roles: List[str], beats: List[dict], exit_code: Optional[int]) -> Liveness:
    """The state of a Slurm run from its jobs' states (``statuses[i]`` of the job whose role is ``roles[i]``)."""
    train = [s for s, r in zip(statuses, roles) if r == "train"]
    if "running" in train:
        return Liveness("running", "the training job is running", beats)
    if any(s in ("queued", "requeued", "held") for s in train):
        return Liveness("queued", "the training job is held" if "held" in train else
                        "the training job waits in the queue", beats)
    if train and all(s == "unknown" for s in train):
        return Liveness("unknown", "Slurm does not say whether the training job runs", beats)
    if exit_code == 0 or (train and train[-1] == "done"):
        return Liveness("finished", "the training job is done", beats)
    return Liveness("stopped", "no training job is running or queued", beats)


__all__ = ["Liveness", "local_liveness", "pid_alive", "read_heartbeats", "slurm_liveness"]
