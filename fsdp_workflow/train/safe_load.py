"""Loading checkpoints without running code from their pickles.

``checkpoint.resume`` may name a directory someone else wrote, and both formats
hold pickles that their own readers unpickle unrestricted:

* DCP's ``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on
  ``.metadata``: :class:`SafeFileSystemReader` reads it through the project's one
  allow-list (:mod:`fsdp_workflow.core.safe_pickle`, shared with the consolidator).
  DCP turns a failed read into a fallback to per-rank metadata files and an
  assertion that buries the reason, so :func:`check_dcp_metadata` reads it
  first and refuses with the allow-list's own message.
* DCP's default load planner reads non-tensor items (ints, the optimizer's param
  groups) with ``weights_only=False``: :class:`SafeLoadPlanner` uses ``weights_only=True``.
* DeepSpeed's ``load_checkpoint`` unpickles its ``*.pt`` files with
  ``weights_only=False``: :func:`check_deepspeed_pickles` reads every one with
  ``core.safe_pickle.load_torch_file`` first and refuses the resume unless all pass.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_workflow.core import rundir
from fsdp_workflow.core.safe_pickle import CorruptPickleError, UnsafePickleError, load_dcp_metadata, load_torch_file
from fsdp_workflow.train.checkpoint import CheckpointError

# The errors by which core.safe_pickle refuses a file (nothing in it was executed).
REFUSALS = (UnsafePickleError, CorruptPickleError)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP load planner whose non-tensor items go through ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through ``core.safe_pickle``'s allow-list.

    Raises (from :meth:`read_metadata`, wrapped by DCP in a ``CheckpointException``):
        UnsafePickleError: ``.metadata`` names a global outside the allow-list.
        CorruptPickleError: ``.metadata`` is truncated or not a pickle.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_dcp_metadata(path: Path) -> None:
    """Refuse a DCP checkpoint whose ``.metadata`` the allow-list does not accept.

    Args:
        path: a ``step-N`` directory written by DCP.

    Raises:
        CheckpointError: ``.metadata`` names a global outside the allow-list, or is
            missing, truncated or corrupt; nothing in it was executed.
    """
    try:
        load_dcp_metadata(Path(path) / rundir.DCP_METADATA)
    except REFUSALS as exc:
        raise CheckpointError(f"refusing to resume from {path}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"refusing to resume from {path}: cannot read its {rundir.DCP_METADATA}: {exc}") from None


def check_deepspeed_pickles(path: Path) -> None:
    """Refuse a DeepSpeed checkpoint whose ``*.pt`` files hold anything but tensors and plain records.

    Args:
        path: a ``step-N`` directory in DeepSpeed's format.

    Raises:
        CheckpointError: no ``*.pt`` file, or one refused (named in the message); nothing in it was executed.
    """
    files = sorted(Path(path).rglob("*.pt"))
    if not files:
        raise CheckpointError(f"{path}: no DeepSpeed *.pt files here; not a complete DeepSpeed checkpoint")
    for f in files:
        try:
            load_torch_file(f)
        except REFUSALS as exc:
            raise CheckpointError(f"refusing to resume: {exc}") from None
