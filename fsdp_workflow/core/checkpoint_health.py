"""Is a complete-looking checkpoint whole? A cheap check shared by resume, ``status`` and the consolidator.

A ``step-N`` is *complete* when DCP's ``.metadata`` (or DeepSpeed's ``latest``)
exists (:func:`fsdp_workflow.core.rundir.is_complete_checkpoint`). That says the
save finished, not that the files survived: a shard truncated by a full disk or
a copy, or a ``.metadata`` garbled on a flaky filesystem, still looks complete,
and resuming from it kills a requeued job after hours in the queue.

:func:`checkpoint_problem` reads what is cheap to read and says what is wrong:

* DCP: ``.metadata`` parses through the allow-list of
  :mod:`fsdp_workflow.core.safe_pickle` (into torch-free placeholders: no torch
  import, so ``status`` and the consolidator stay fast), declares at least one
  item, and every storage item's byte range ``[offset, offset + length)`` lies
  inside its file;
* DeepSpeed: ``latest`` names a tag directory, and each of its ``*.pt`` files is
  a zip archive whose central directory (at the end of the file) reads.

It reads no tensor data: a flipped bit inside a shard is not caught here (DCP
keeps no checksums). The consolidator verifies every byte it copies.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any, Optional

from .rundir import DCP_METADATA, DEEPSPEED_LATEST
from .safe_pickle import AllowListUnpickler, UnsafePickleError


class _Placeholder:
    """Stands in for every allowed class: keeps constructor arguments and pickled state as attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):  # (dict, slots) from classes with __slots__
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)


class _StructureUnpickler(AllowListUnpickler):
    """The shared allow-list, resolved to :class:`_Placeholder` subclasses (plain containers stay real)."""

    def resolve(self, module: str, name: str) -> Any:
        if module in ("builtins", "collections"):
            return super().resolve(module, name)
        return type(name, (_Placeholder,), {})


def dcp_problem(path: Path, report_unsafe: bool = True) -> Optional[str]:
    """What is wrong with the DCP checkpoint in ``path`` (None: it looks whole).

    Args:
        path: the directory holding ``.metadata``.
        report_unsafe: False returns None for a ``.metadata`` the allow-list refuses, so a
            caller whose own reader refuses it loudly (the consolidator: a tampered file is an
            error, not a step to skip quietly) gets that error instead.
    """
    meta_path = path / DCP_METADATA
    try:
        data = meta_path.read_bytes()
        metadata = _StructureUnpickler(io.BytesIO(data), str(meta_path)).load()
    except UnsafePickleError as exc:
        return str(exc) if report_unsafe else None
    except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt file
        return f"{meta_path} cannot be parsed ({type(exc).__name__}: {exc}): truncated or garbled"
    items = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(items, dict) or not items or not isinstance(storage, dict):
        return f"{meta_path} parses but declares no items: garbled"
    sizes: dict[str, int] = {}
    for info in storage.values():
        rel = str(getattr(info, "relative_path", ""))
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not rel or not isinstance(offset, int) or not isinstance(length, int):
            return f"{meta_path} has a storage entry without a file, offset or length: garbled"
        if rel not in sizes:
            try:
                sizes[rel] = os.stat(path / rel).st_size
            except OSError as exc:
                return f"shard {path / rel} named by {DCP_METADATA} is missing ({exc.strerror})"
        if offset + length > sizes[rel]:
            return (f"shard {path / rel} is truncated: {DCP_METADATA} puts an item at bytes "
                    f"{offset}..{offset + length} but the file has {sizes[rel]} bytes")
    return None


def deepspeed_problem(path: Path) -> Optional[str]:
    """What is wrong with the DeepSpeed checkpoint in ``path`` (None: it looks whole)."""
    try:
        tag = (path / DEEPSPEED_LATEST).read_text().strip()
    except OSError as exc:
        return f"{path / DEEPSPEED_LATEST} cannot be read ({exc.strerror})"
    tag_dir = path / tag
    files = sorted(tag_dir.glob("*.pt")) if tag and tag_dir.is_dir() else []
    if not files:
        return f"{path / DEEPSPEED_LATEST} names tag {tag!r} but {tag_dir} holds no *.pt files"
    for f in files:
        try:
            with zipfile.ZipFile(f) as z:
                z.namelist()
        except (OSError, zipfile.BadZipFile) as exc:
            return f"{f} is truncated or corrupt ({type(exc).__name__}: {exc})"
    return None


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why the complete-looking checkpoint ``path`` cannot be trusted, or None when it looks whole.

    Args:
        path: a ``step-N`` directory (DCP or DeepSpeed).

    Returns:
        One sentence naming the file and what is wrong with it, or None.
    """
    path = Path(path)
    if (path / DCP_METADATA).is_file():
        return dcp_problem(path)
    if (path / DEEPSPEED_LATEST).is_file():
        return deepspeed_problem(path)
    return f"{path} has neither {DCP_METADATA} nor {DEEPSPEED_LATEST}: not a complete checkpoint"
