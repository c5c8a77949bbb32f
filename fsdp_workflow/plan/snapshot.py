"""The code snapshot: the package as it was when the run was planned, in ``RUN_DIR/code``.

A job can wait in the queue for hours. Without a snapshot it imports whatever
``fsdp_workflow`` is installed when it starts, so a user who edits the checkout
or switches branches meanwhile runs code they never submitted (submitit and
NeMo-Run snapshot for the same reason). With ``cluster.code_snapshot=true`` (the
default) the planner copies the imported package's own directory (its ``.py``
files, the Hydra ``conf/`` tree, the shipped ``assets/``; no bytecode) into
``RUN_DIR/code/fsdp_workflow`` and every job puts ``RUN_DIR/code`` first on
``PYTHONPATH`` (:mod:`fsdp_workflow.plan.render`, :mod:`fsdp_workflow.backends.local`,
and inside containers :func:`fsdp_workflow.container.wrap.explicit_env`).

The copy is written beside the target and renamed into place, and its content
hash (sha256 over each file's relative path and bytes, in sorted order) goes into
``provenance.json``. About 1 MB and a few hundred files: tens of milliseconds.

On a full disk (a run that stopped with exit 74 and is resubmitted before anything
was freed) the copy is refused before it starts, or its partial copy removed when
the disk fills meanwhile: :class:`SnapshotDiskFull` says how much space it needs and
what to free, and ends the command with exit 74, no traceback, nothing left behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

from fsdp_workflow.core.exit_codes import DISK_FULL_ERRNOS, EXIT_DISK_FULL
from fsdp_workflow.core.rundir import RunDir

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the package this module belongs to
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def package_files(root: Path = PACKAGE_DIR) -> Iterator[Path]:
    """The package's files that a job needs, relative to ``root``, sorted (no bytecode, no caches).

    Directory links are followed: in a checkout ``fsdp_workflow/conf`` links to the
    top-level ``conf/`` (pyproject.toml), and the snapshot must hold the tree itself.
    """
    found: List[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        base = Path(dirpath)
        found += [(base / f).relative_to(root) for f in filenames
                  if not f.endswith(_SKIP_SUFFIXES) and (base / f).is_file()]
    yield from sorted(found)


def content_hash(root: Path) -> str:
    """sha256 over every snapshot file's relative path and bytes, in sorted order."""
    h = hashlib.sha256()
    for rel in package_files(root):
        h.update(rel.as_posix().encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


_BLOCK = 4096  # a file takes whole blocks: count each one rounded up, and one per directory


class SnapshotDiskFull(SystemExit):
    """The code snapshot does not fit on the run directory's filesystem: exit 74, with the message printed.

    A :class:`SystemExit`, so the command ends with :data:`~fsdp_workflow.core.exit_codes.EXIT_DISK_FULL`
    and no traceback wherever it is raised; ``message`` says how much is needed and what to free.
    """

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_DISK_FULL)
        self.message = message


def _needed_bytes(source: Path, files: List[Path]) -> int:
    dirs = {rel.parent for rel in files}
    return sum(-(-(source / rel).stat().st_size // _BLOCK) * _BLOCK for rel in files) + _BLOCK * (len(dirs) + 1)


def _mb(n: int) -> str:
    return f"{max(n, 0) / 1e6:.1f} MB"


def _disk_full(code_dir: Path, need: int) -> SnapshotDiskFull:
    """The error, printed now (the command ends with it); the space needed, what is free, what to free."""
    free = shutil.disk_usage(code_dir).free
    checkpoints = RunDir(code_dir.parent).checkpoints  # the snapshot's directory sits in the run directory
    message = (f"fsdp_workflow: disk full (ENOSPC): the code snapshot needs {_mb(need)} in {code_dir}, "
               f"and its filesystem has {_mb(free)} free; nothing was written. Free at least "
               f"{_mb(need - free)} there (e.g. older checkpoints you no longer need under {checkpoints}), "
               "or plan with cluster.code_snapshot=false; then run the same command again.")
    print(message, file=sys.stderr, flush=True)
    return SnapshotDiskFull(message)


def write_snapshot(code_dir: Path, source: Path = PACKAGE_DIR) -> Dict[str, object]:
    """Copy the package into ``code_dir/<package name>``, replacing an earlier snapshot; return its record.

    Returns:
        ``{"path", "sha256", "files", "bytes", "seconds", "source"}`` for ``provenance.json``.

    Raises:
        SnapshotDiskFull: the filesystem has too little space (checked first, and on ENOSPC/EDQUOT
            while copying); the partial copy is removed.
    """
    t0 = time.monotonic()
    code_dir.mkdir(parents=True, exist_ok=True)
    final = code_dir / source.name
    tmp = code_dir / f".{source.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed planner left
    todo = list(package_files(source))
    need = _needed_bytes(source, todo)
    if shutil.disk_usage(code_dir).free < need:
        raise _disk_full(code_dir, need)
    files = total = 0
    try:
        for rel in todo:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, tmp / rel)
            files += 1
            total += (tmp / rel).stat().st_size
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)  # never a half snapshot beside the real one
        if err.errno in DISK_FULL_ERRNOS:
            raise _disk_full(code_dir, need) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    digest = content_hash(tmp)
    old = code_dir / f".{source.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)  # replanning the run: the new snapshot replaces the old one whole
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return {"path": str(final), "sha256": digest, "files": files, "bytes": total,
            "seconds": round(time.monotonic() - t0, 3), "source": str(source)}
