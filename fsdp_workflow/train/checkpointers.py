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

:func:`fsdp_workflow.train.strategies.make_checkpointer` picks one: each strategy's
trainer half names its checkpointer (:func:`dcp_checkpointer` unless it says otherwise).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, NoReturn, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_workflow.config.schema import CheckpointConfig
from fsdp_workflow.train import fault_hooks, resume
from fsdp_workflow.train.checkpoint import CheckpointDir, Checkpointer, CheckpointError, CheckpointSaveError, barrier
from fsdp_workflow.train.failures import disk_full_detail
from fsdp_workflow.train.parallel import Prepared
from fsdp_workflow.train.safe_load import (
    SafeFileSystemReader, SafeLoadPlanner, check_dcp_metadata, check_deepspeed_pickles,
)

# The parts DeepSpeed's engine saves itself; the others go into its client_state.
ENGINE_PARTS = frozenset({"model", "optimizer"})


class DcpCheckpointer:
    """Checkpoints of ``Stateful`` parts with ``torch.distributed.checkpoint``.

    A save that fails on a full disk raises :class:`~.checkpoint.CheckpointSaveError`
    on every rank (DCP shares each rank's failure with all) after rank 0 removed
    its ``step-N.tmp``.

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
        self._fault = fault_hooks.from_env()  # None unless a reliability test asks for one

    def save(self, step: int, parts: Mapping[str, Stateful], *, blocking: bool = False) -> None:
        self.wait()  # one save in flight at a time
        tmp = self.dir.begin(step)
        writer = fault_hooks.save_writer(tmp, step, self.dir.rank, self._fault)
        try:
            if self.async_save and not blocking:
                # The parts' state_dict() runs now; only the write happens in the background.
                self._pending = (dcp.async_save(dict(parts), storage_writer=writer, process_group=self.async_group), step)
                return
            dcp.save(dict(parts), storage_writer=writer)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            _raise_save_failure(self.dir, step, exc)
        self.dir.commit(step)
        barrier()

    def load(self, path: Path, parts: Mapping[str, Stateful]) -> None:
        """Load ``path`` into ``parts`` in place (DTensors resharded as needed).

        A part that can start afresh from the weights (one with ``restart()``: the
        EMA) and that the checkpoint lacks, because it was saved without it, is
        restarted after the others loaded, with a warning.

        Raises:
            CheckpointError: ``.metadata`` was refused by the allow-list (crafted or corrupt); nothing ran.
            ResumeError: a part's ``check_loadable`` refused the checkpoint (another optimizer, another
                model shape); nothing was loaded.
        """
        check_dcp_metadata(path)
        reader = SafeFileSystemReader(path)
        entries = reader.read_metadata().state_dict_metadata
        roots = {key.split(".", 1)[0] for key in entries}
        for key, part in parts.items():  # a change the resume cannot apply is refused before anything loads
            check = getattr(part, "check_loadable", None)
            if check is not None and key in roots:
                check({k[len(key) + 1:]: v for k, v in entries.items() if k.startswith(key + ".")})
        absent = [key for key, part in parts.items() if key not in roots and hasattr(part, "restart")]
        dcp.load({k: v for k, v in parts.items() if k not in absent}, storage_reader=reader, planner=SafeLoadPlanner())
        for key in absent:
            parts[key].restart()  # type: ignore[attr-defined]
            if self.dir.rank == 0:
                print(f"[fsdp_workflow] warning: {path} holds no '{key}' (saved without it): it starts from the "
                      "loaded weights now", file=sys.stderr, flush=True)

    def poll(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as exc:
            _raise_save_failure(self.dir, step, exc)
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
        try:
            self.engine.save_checkpoint(str(tmp), tag=f"global_step{step}", client_state=client_state)
        except BaseException as exc:
            _raise_save_failure(self.dir, step, exc)
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
        # The engine restores its optimizer's param groups as saved; the config's hyperparameters win.
        optimizer = getattr(parts.get("optimizer"), "optimizer", None)
        config = resume.hyperparameters(optimizer) if optimizer is not None else None
        _, client_state = self.engine.load_checkpoint(str(path))
        if client_state is None:
            raise CheckpointError(f"{path}: DeepSpeed could not load this checkpoint")
        if config is not None:
            resume.keep_hyperparameters(optimizer, config)
        for key, part in parts.items():
            if key not in ENGINE_PARTS:
                part.load_state_dict(client_state[key])

    def poll(self) -> None:
        """Nothing runs in the background."""

    def wait(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        self.dir.close()


def _raise_save_failure(directory: CheckpointDir, step: int, exc: BaseException) -> NoReturn:
    """Re-raise a failed save; on a full disk, as :class:`CheckpointSaveError` after removing ``step-N.tmp``."""
    tmp = directory.run.step_tmp(step)
    detail = disk_full_detail(exc, tmp)
    if detail is None:
        raise exc
    directory.abandon(step)
    raise CheckpointSaveError(step, tmp, detail) from exc


def dcp_checkpointer(directory: CheckpointDir, cfg: CheckpointConfig, prepared: Prepared,
                     timeout_s: float) -> Checkpointer:
    """The DCP checkpointer, every strategy's but DeepSpeed's (arguments: :func:`.strategies.make_checkpointer`).

    ``timeout_s`` goes to the background-save group: ``new_group`` would otherwise give it
    the 30-minute default. Every rank must call this (it may create a process group).
    """
    group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
             if cfg.async_save and dist.is_initialized() else None)
    return DcpCheckpointer(directory, cfg.async_save, group)
