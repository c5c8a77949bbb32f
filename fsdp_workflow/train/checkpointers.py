"""The two implementations of :class:`~.checkpoint.Checkpointer`: DCP and DeepSpeed.

* :class:`DcpCheckpointer` - ``torch.distributed.checkpoint`` of every part
  (FSDP2/FSDP1/DDP). Every rank writes its shards into ``step-N.tmp``; DCP's
  coordinator writes ``.metadata`` only after gathering all ranks' results, so
  when rank 0's save returns the checkpoint is whole and rank 0 commits it.
  With ``checkpoint.async_save`` the save runs on a separate gloo group (its
  collectives must not interleave with training's) and commits when done.
* :class:`DeepSpeedCheckpointer` - DeepSpeed's own format (``latest``,
  ``global_stepN/``, which ``zero_to_fp32`` and the consolidator read): the
  engine writes the ``model`` and ``optimizer`` parts, every other part rides in
  its ``client_state`` under its key. Synchronous, same tmp-then-rename commit.

:func:`make_checkpointer` picks one for the strategy: the only place the
training loop's path depends on it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_workflow.config.schema import CheckpointConfig
from fsdp_workflow.train.checkpoint import SAVE_DELAY_ENV, CheckpointDir, Checkpointer, CheckpointError, barrier
from fsdp_workflow.train.parallel import Prepared
from fsdp_workflow.train.safe_load import (
    SafeFileSystemReader, SafeLoadPlanner, check_dcp_metadata, check_deepspeed_pickles,
)

# The parts DeepSpeed's engine saves itself; the others go into its client_state.
ENGINE_PARTS = frozenset({"model", "optimizer"})


class DcpCheckpointer:
    """Checkpoints of ``Stateful`` parts with ``torch.distributed.checkpoint``.

    Args:
        directory: where saves are written and committed.
        async_save: ``checkpoint.async_save``: saves that are not ``blocking`` run in the background.
        async_group: the gloo group for background saves (None: the default group).
    """

    def __init__(self, directory: CheckpointDir, async_save: bool = False, async_group: Any = None) -> None:
        self.dir = directory
        self.async_save = async_save
        self.async_group = async_group
        self._pending: Optional[Tuple[Any, int]] = None  # (future, step)

    def save(self, step: int, parts: Mapping[str, Stateful], *, blocking: bool = False) -> None:
        self.wait()  # one save in flight at a time
        writer = _writer(self.dir.begin(step))
        if self.async_save and not blocking:
            # The parts' state_dict() runs now; only the write happens in the background.
            self._pending = (dcp.async_save(dict(parts), storage_writer=writer, process_group=self.async_group), step)
            return
        dcp.save(dict(parts), storage_writer=writer)
        self.dir.commit(step)
        barrier()

    def load(self, path: Path, parts: Mapping[str, Stateful]) -> None:
        """Load ``path`` into ``parts`` in place (DTensors resharded as needed).

        Raises:
            CheckpointError: ``.metadata`` was refused by the allow-list (crafted or corrupt); nothing ran.
        """
        check_dcp_metadata(path)
        dcp.load(dict(parts), storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())

    def poll(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        future.result()
        self.dir.commit(step)

    def close(self) -> None:
        self.dir.close()


class DeepSpeedCheckpointer:
    """Checkpoints in DeepSpeed's own format, through its engine.

    Args:
        directory: where saves are written and committed.
        engine: the ``DeepSpeedEngine`` (Accelerate's prepared model).
    """

    def __init__(self, directory: CheckpointDir, engine: Any) -> None:
        self.dir = directory
        self.engine = engine

    def save(self, step: int, parts: Mapping[str, Stateful], *, blocking: bool = False) -> None:
        """Always blocking: DeepSpeed's save is synchronous."""
        tmp = self.dir.begin(step)
        client_state = {key: part.state_dict() for key, part in parts.items() if key not in ENGINE_PARTS}
        self.engine.save_checkpoint(str(tmp), tag=f"global_step{step}", client_state=client_state)
        barrier()  # every rank's partition is on disk
        self.dir.commit(step)
        barrier()

    def load(self, path: Path, parts: Mapping[str, Stateful]) -> None:
        """Load the engine's model and optimizer, then the other parts from the client state.

        Raises:
            CheckpointError: a ``*.pt`` file holds more than tensors and DeepSpeed's plain
                records (checked before DeepSpeed unpickles anything), or DeepSpeed found no checkpoint.
        """
        check_deepspeed_pickles(path)
        _, client_state = self.engine.load_checkpoint(str(path))
        if client_state is None:
            raise CheckpointError(f"{path}: DeepSpeed could not load this checkpoint")
        for key, part in parts.items():
            if key not in ENGINE_PARTS:
                part.load_state_dict(client_state[key])

    def poll(self) -> None:
        """Nothing runs in the background."""

    def wait(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        self.dir.close()


def make_checkpointer(directory: CheckpointDir, cfg: CheckpointConfig, prepared: Prepared) -> Checkpointer:
    """The checkpointer for ``prepared.strategy``: DeepSpeed's engine, or DCP for everything else.

    Args:
        directory: ``RUN_DIR/checkpoints`` for this rank.
        cfg: the ``checkpoint`` group.
        prepared: the wrapped model and how it was wrapped.

    Returns:
        A :class:`~.checkpoint.Checkpointer`. Every rank must call this (it may create a process group).
    """
    if prepared.strategy == "deepspeed":
        return DeepSpeedCheckpointer(directory, prepared.model)
    group = dist.new_group(backend="gloo") if cfg.async_save and dist.is_initialized() else None
    return DcpCheckpointer(directory, cfg.async_save, group)


class _DelayedWriter(FileSystemWriter):
    """FileSystemWriter that pauses before writing ``.metadata`` (tests only)."""

    def __init__(self, *args: Any, delay_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delay_s = delay_s

    def finish(self, metadata: Any, results: Any) -> None:
        time.sleep(self._delay_s)
        super().finish(metadata, results)


def _writer(tmp: Path) -> FileSystemWriter:
    delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
    return _DelayedWriter(tmp, delay_s=delay) if delay > 0 else FileSystemWriter(tmp)
