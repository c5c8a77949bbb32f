"""The code snapshot: the package as it was when the run was planned, in ``RUN_DIR/code``.

A job can wait in the queue for hours. Without a snapshot it imports whatever
``fsdp_workflow`` is installed when it starts, so a user who edits the checkout
or switches branches meanwhile runs code they never submitted (submitit and
NeMo-Run snapshot for the same reason). With ``cluster.code_snapshot=true`` (the
default) the planner copies the imported package's own directory (its ``.py``
files, the Hydra ``conf/`` tree, the shipped ``assets/``; no bytecode) into
``RUN_DIR/code/fsdp_workflow`` and every job puts ``RUN_DIR/code`` first on
``PYTHONPATH`` (:mod:`fsdp_workflow.plan.render`, :mod:`fsdp_workflow.launch.local`,
and inside containers :func:`fsdp_workflow.container.wrap.explicit_env`).

The copy is written beside the target and renamed into place, and its content
hash (sha256 over each file's relative path and bytes, in sorted order) goes into
``provenance.json``. About 1 MB and a few hundred files: tens of milliseconds.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Dict, Iterator

import fsdp_workflow

PACKAGE_DIR = Path(fsdp_workflow.__file__).resolve().parent
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def package_files(root: Path = PACKAGE_DIR) -> Iterator[Path]:
    """The package's files that a job needs, relative to ``root``, sorted (no bytecode, no caches)."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not _SKIP_DIRS.intersection(rel.parts) and not path.name.endswith(_SKIP_SUFFIXES):
            yield rel


def content_hash(root: Path) -> str:
    """sha256 over every snapshot file's relative path and bytes, in sorted order."""
    h = hashlib.sha256()
    for rel in package_files(root):
        h.update(rel.as_posix().encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def write_snapshot(code_dir: Path, source: Path = PACKAGE_DIR) -> Dict[str, object]:
    """Copy the package into ``code_dir/<package name>``, replacing an earlier snapshot; return its record.

    Returns:
        ``{"path", "sha256", "files", "bytes", "seconds", "source"}`` for ``provenance.json``.
    """
    t0 = time.monotonic()
    code_dir.mkdir(parents=True, exist_ok=True)
    final = code_dir / source.name
    tmp = code_dir / f".{source.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    files = total = 0
    for rel in package_files(source):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, tmp / rel)
        files += 1
        total += (tmp / rel).stat().st_size
    digest = content_hash(tmp)
    old = code_dir / f".{source.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)  # replanning the run: the new snapshot replaces the old one whole
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return {"path": str(final), "sha256": digest, "files": files, "bytes": total,
            "seconds": round(time.monotonic() - t0, 3), "source": str(source)}
