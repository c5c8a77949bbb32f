"""Replace an OUT that cannot be renamed in place: a mount point (a container's bind-mounted ``/output``).

The usual commit (:func:`.steps.commit_output`) stages the model beside OUT and renames it
in, renaming an earlier OUT aside first: ``os.rename`` of a mount point fails with EBUSY,
and a staging directory beside it lands on another filesystem (or in a read-only parent).
So when OUT exists and cannot be renamed (:func:`cannot_rename`), everything happens
inside OUT instead:

- the lock is ``OUT/.consolidate.lock``, removed when the consolidation ends;
- the model is staged in ``OUT/.consolidate-tmp-PID`` (OUT's own filesystem, so each file
  is then moved by a rename);
- the commit (:func:`commit_in_place`) moves ``verification.json`` out of OUT first, then
  OUT's other entries into ``OUT/.consolidate-old-PID``, then the new files in, and
  ``verification.json`` last. So OUT is never a mix of two models that looks complete: while
  the renames run (milliseconds) OUT holds no ``verification.json``; a process killed there
  leaves it so, and the earlier model under ``.consolidate-old-PID``, which the next
  consolidation into OUT removes (:func:`leftovers`).

What this does not give that the rename does: a reader listing OUT during the renames sees
part of each model. A reader that trusts only a directory holding ``verification.json``
never takes it for a model (``status`` calls one without it ``present``, not ``verified``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from pathlib import Path

from fsdp_workflow.core.lock import Lock, read_holder
from fsdp_workflow.core.modeldir import VERIFICATION_FILE
from fsdp_workflow.core.rundir import fsync_dir

from .consolidation_errors import ConsolidationError

LOCK_NAME = ".consolidate.lock"  # inside OUT
STAGING_PREFIX = ".consolidate-tmp-"  # + pid, inside OUT
OLD_PREFIX = ".consolidate-old-"  # + pid: OUT's earlier entries during the commit
_OCTAL = re.compile(r"\\([0-7]{3})")


def _mount_points() -> set[str] | None:
    """Every mount point of this process's namespace (``/proc/self/mountinfo``), or None without /proc."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    # field 5 is the mount point, with space, tab, newline and backslash as octal escapes
    return {_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ")[4]) for line in lines if line.count(" ") >= 4}


def is_mount_point(path: Path) -> bool:
    """Whether ``path`` is a mount point, bind mounts of a directory on the same disk included.

    ``os.path.ismount`` compares devices, so it misses a bind mount from the same
    filesystem; the kernel's own list does not.
    """
    if os.path.ismount(path):
        return True
    points = _mount_points()
    return points is not None and os.path.realpath(path) in points


def cannot_rename(out: Path) -> str | None:
    """Why an existing directory ``out`` cannot be renamed, so that it must be replaced in place; None when it can.

    Args:
        out: The output directory.

    Returns:
        ``"it is a mount point"``, ``"its parent ... is not writable by this user"``, or None
        (it does not exist, is not a directory, or can be renamed).
    """
    if out.is_symlink() or not out.is_dir():
        return None
    if is_mount_point(out):
        return "it is a mount point"
    parent = Path(os.path.realpath(out)).parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"its parent {parent} is not writable by this user"
    st = parent.stat()
    if st.st_mode & stat.S_ISVTX and os.geteuid() not in (0, st.st_uid, out.stat().st_uid):
        return f"its parent {parent} is sticky (like /tmp) and neither it nor OUT belongs to this user"
    return None


def in_place_problem(out: Path) -> str | None:
    """Why ``out`` cannot be replaced in place either (this user cannot write into it), or None.

    Returns:
        The refusal, naming OUT, why it cannot be renamed, and the fix; None when it is fine.
    """
    why = cannot_rename(out)
    if why is None or os.access(out, os.W_OK | os.X_OK):
        return None
    mount = why == "it is a mount point"
    fix = ("Mount it writable (docker run -v HOST_DIR:/output, without :ro)" if mount
           else f"Give this user write permission on it (chmod u+w {out})")
    return (f"{out}: OUT is {'a mount point' if mount else 'a directory that cannot be renamed'} ({why}), so the "
            "model would be written into it in place, and this user cannot write into it "
            f"({'a read-only filesystem' if _read_only(out) else 'no write permission'}). {fix}, or choose an OUT "
            "you can write; nothing was written")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def staging_path(out: Path) -> Path:
    """This process's staging directory inside OUT."""
    return out / f"{STAGING_PREFIX}{os.getpid()}"


def lock_file(out: Path) -> Path:
    return out / LOCK_NAME


def owns(lock: Lock) -> bool:
    """Whether the lock file still names this process: one removed by a finishing holder after we opened it does not."""
    holder = read_holder(lock.path)
    return holder is not None and holder.pid == os.getpid()


def release(lock: Lock) -> None:
    """Remove the lock file from OUT, then release it: no stray file in the user's directory."""
    try:
        lock.path.unlink()
    except OSError:
        pass
    lock.release()


def leftovers(out: Path) -> list[tuple[Path, str]]:
    """(directory, pid) of every staging or earlier-model directory in OUT that some consolidation left."""
    found = []
    for prefix in (STAGING_PREFIX, OLD_PREFIX):
        for path in sorted(out.glob(prefix + "*")) if out.is_dir() else []:
            pid = path.name[len(prefix):]
            if pid.isdigit() and path.is_dir():
                found.append((path, pid))
    return found


def is_empty(out: Path) -> bool:
    """Whether the directory ``out`` holds nothing but a consolidation's own lock and staging (nothing to lose)."""
    try:
        return out.is_dir() and not out.is_symlink() and all(_ours(p.name) for p in out.iterdir())
    except OSError:
        return False


def _ours(name: str) -> bool:
    """Entries of OUT the commit leaves alone: the lock, staging and earlier-model directories."""
    return name == LOCK_NAME or name.startswith((STAGING_PREFIX, OLD_PREFIX))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def commit_in_place(staging: Path, out: Path) -> None:
    """Move the verified model from ``staging`` (inside ``out``) into ``out``, replacing what ``out`` held.

    ``verification.json`` leaves first and comes back last (see the module docstring). The
    caller holds Ctrl-C off around it.

    Raises:
        ConsolidationError: A rename failed (the earlier entries are put back where they can be).
    """
    old = out / f"{OLD_PREFIX}{os.getpid()}"
    old.mkdir()
    moved_old: list[str] = []
    moved_new: list[str] = []
    try:
        entries = sorted(p.name for p in out.iterdir() if not _ours(p.name))
        if VERIFICATION_FILE in entries:  # OUT stops looking complete before anything else changes
            entries.remove(VERIFICATION_FILE)
            entries.insert(0, VERIFICATION_FILE)
        for name in entries:
            os.rename(out / name, old / name)
            moved_old.append(name)
        new = sorted(p.name for p in staging.iterdir() if p.name != VERIFICATION_FILE) + [VERIFICATION_FILE]
        for name in new:
            os.rename(staging / name, out / name)
            moved_new.append(name)
        fsync_dir(out)
    except OSError as exc:
        for name in reversed(moved_new):  # the new model out again, then the earlier entries back
            _remove(out / name)
        for name in reversed(moved_old):
            try:
                os.rename(old / name, out / name)
            except OSError:
                pass
        with contextlib.suppress(OSError):
            old.rmdir()  # empty once everything is back
        raise ConsolidationError(
            f"{out}: cannot move the verified model into OUT ([Errno {exc.errno}] {exc.strerror} on {exc.filename}); "
            f"OUT's earlier files were put back where possible (any left are in {old}). Check that OUT is writable "
            "and rerun the same command") from None
    staging.rmdir()
    shutil.rmtree(old, ignore_errors=True)
