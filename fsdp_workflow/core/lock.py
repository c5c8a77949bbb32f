"""One holder at a time: an exclusive ``flock`` on a lock file, which names its holder.

Two commands on one run directory (or two consolidations into one output) must
not both write. Each takes :func:`acquire` on a lock file first; the second is
refused at once with :class:`LockHeld`, whose message names the holder (what it
is doing, host, pid, Slurm job id, since when) from the JSON the holder wrote
into the file.

Why ``flock`` and not a pid file: the kernel releases the lock when its holder
dies (``kill -9``, a node reboot's lost lease), so a crash never leaves a stale
lock that the user must delete by hand, and a requeued Slurm job takes the lock
back simply by acquiring it again. The file itself is left in place (removing
it would race with a second process that has already opened it).

The lock belongs to the open file, not to one process: a holder that passes its
descriptor to a child (:meth:`Lock.fileno`, ``pass_fds``) shares it, and the kernel
frees it only when every process holding it has exited. The local launcher passes
it to everything it starts, so a run whose command was killed stays locked until
its last process is gone; the refusal then names those processes (:func:`openers`).

What ``flock`` promises on shared filesystems:

- local disks, tmpfs: exact.
- NFS (Linux client, v3 with NLM or v4): the client turns ``flock`` into a
  whole-file POSIX byte-range lock, so it excludes across nodes. A holder on a
  node that dies keeps the lock until the server reclaims it (the NFSv4 lease,
  usually 90 s). Mounted with ``nolock`` (or ``local_lock=flock``), locks are
  only local to each node: two nodes can then both hold it.
- Lustre: across nodes only when mounted with ``-o flock``; with ``localflock``
  the lock holds on one node only, and with ``noflock`` (an old default)
  ``flock`` fails with ENOSYS, which is raised here as :class:`LockUnsupported`
  rather than silently ignored.
- GPFS / Spectrum Scale, BeeGFS: coherent across nodes.

Nothing here imports torch, Hydra or Slurm.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as it wrote itself into the lock file."""

    what: str  # e.g. "planning", "training (local launcher)", "consolidating"
    host: str
    pid: int
    job_id: Optional[str] = None  # SLURM_JOB_ID, where the holder runs in a Slurm job
    since: float = 0.0  # time.time() when it took the lock

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "?"
        return f"{self.what} on host {self.host}, pid {self.pid}{job}, since {when}"

    def is_ancestor_of_me(self) -> bool:
        """True when the holder is this process or one of its ancestors on this host.

        The local launcher holds a run's lock while its torchrun ranks run; rank 0,
        its descendant, then knows the lock is held on its behalf.
        """
        if self.host != socket.gethostname():
            return False
        pid = os.getpid()
        for _ in range(64):  # a process tree is never this deep; stop on a loop
            if pid == self.pid:
                return True
            if pid <= 1:
                return False
            pid = _parent_pid(pid)
            if pid is None:
                return False
        return False


def _parent_pid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields follow the last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def openers(path: PathLike, limit: int = 4) -> List[str]:
    """The live processes on this host that have ``path`` open (``pid N (command line)``), at most ``limit``.

    A holder's children keep the lock it passed them (the local launcher's node script and
    steps) after it died; the lock file names the dead holder, this names who holds it now.
    Only the processes this user may inspect are seen (/proc/PID/fd).
    """
    try:
        target = os.stat(path)
    except OSError:
        return []
    found: List[str] = []
    for entry in sorted(os.listdir("/proc"), key=lambda n: (len(n), n)) if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = "?"
                found.append(f"pid {entry} ({cmd[:120]})")
                break
        if len(found) >= limit:
            break
    return found


def holder_words(path: PathLike, holder: Optional[Holder]) -> str:
    """Who holds the held lock at ``path``, in words: the recorded holder, and, where that process has
    ended on this host, the processes it started that still hold the lock (:func:`openers`)."""
    if holder is None:
        return "another process (it has not written its name yet)"
    who = holder.describe()
    if holder.host == socket.gethostname() and not _alive(holder.pid):
        # Its processes hold the lock it passed them (fsdp_workflow.core.lifeline stops them).
        still = openers(path)
        who += (f" (pid {holder.pid} has ended; processes it started still hold the lock: "
                f"{', '.join(still) if still else 'not visible to this user'})")
    return who


class LockHeld(RuntimeError):
    """The lock is held by someone else (named in the message)."""

    def __init__(self, path: Path, holder: Optional[Holder], subject: str = "") -> None:
        self.path = path
        self.holder = holder
        who = holder_words(path, holder)
        about = subject or str(path.parent)
        super().__init__(f"{about} is in use by {who} (lock file {path}). Wait for it to finish, "
                         "or stop it; the lock is released as soon as that process exits.")


class LockUnsupported(OSError):
    """The filesystem refuses ``flock`` (Lustre mounted ``noflock``)."""


def read_holder(path: PathLike) -> Optional[Holder]:
    """The holder recorded in a lock file, or None (no file, empty, or unreadable)."""
    try:
        data = json.loads(Path(path).read_text() or "null")
        return Holder(what=str(data["what"]), host=str(data["host"]), pid=int(data["pid"]),
                      job_id=data.get("job_id"), since=float(data.get("since", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_locked(path: PathLike) -> bool:
    """Whether someone holds the lock now (probes by taking it for an instant)."""
    path = Path(path)
    if not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


class Lock:
    """A held lock; release it with :meth:`release` or by leaving a ``with`` block."""

    def __init__(self, path: Path, fd: int, holder: Holder) -> None:
        self.path = path
        self.holder = holder
        self._fd: Optional[int] = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        """The locked descriptor. A child given it (``pass_fds``) shares the lock: the kernel frees it
        only when the last process holding the descriptor has closed it or died."""
        assert self._fd is not None, "the lock was released"
        return self._fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # no stale name for the next reader
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(path: PathLike, what: str, subject: str = "") -> Lock:
    """Take the lock at ``path`` now, or raise :class:`LockHeld` naming its holder.

    Args:
        path: the lock file; created (with its parent) if missing.
        what: what the caller is doing, shown to anyone refused ("training", ...).
        subject: what the lock protects, for the refusal's message (default: the
            lock file's directory).

    Raises:
        LockHeld: someone else holds it.
        LockUnsupported: the filesystem does not support ``flock``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockHeld(path, read_holder(path), subject) from None
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise LockUnsupported(err.errno, f"{path}: the filesystem does not support flock ({err.strerror}); "
                                  "on Lustre mount with -o flock") from None
        raise
    holder = Holder(what=what, host=socket.gethostname(), pid=os.getpid(),
                    job_id=os.environ.get("SLURM_JOB_ID") or None, since=time.time())
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder.__dict__) + "\n").encode(), 0)
    return Lock(path, fd, holder)
