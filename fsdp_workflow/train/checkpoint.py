"""The checkpoint interface, and the directory every implementation commits into.

Layout (a contract with the consolidator; names from :mod:`fsdp_workflow.core.rundir`)::

    RUN_DIR/checkpoints/step-N/        a complete checkpoint (DCP .metadata, or DeepSpeed's latest)
    RUN_DIR/checkpoints/step-N.tmp     being written (or left by a crash): ignored by every reader
    RUN_DIR/checkpoints/step-N.deleting  being pruned: ignored by every reader
    RUN_DIR/checkpoints/step-N.corrupt   failed verification at resume: set aside, never deleted

A :class:`Checkpointer` saves and loads a mapping of ``Stateful`` parts
(:mod:`.state`): :class:`~.checkpointers.DcpCheckpointer` with
``torch.distributed.checkpoint``, :class:`~.checkpointers.DeepSpeedCheckpointer`
with DeepSpeed's engine. Both write into ``step-N.tmp`` and hand the commit to
:class:`CheckpointDir`: rank 0 renames it to ``step-N`` once every rank's part is
on disk, fsyncs the directory, prunes to ``checkpoint.keep_last`` (renaming
``step-N`` away before deleting it) and runs the post-checkpoint hook
(:mod:`.hooks`). A crash at any point leaves at most a ``*.tmp`` or ``*.deleting``;
a save that fails on a full disk removes its ``*.tmp`` (:class:`CheckpointSaveError`).
Resuming with ``auto`` takes the newest checkpoint that passes
:func:`~fsdp_workflow.core.checkpoint_health.checkpoint_problem` and sets the
ones that fail aside as ``step-N.corrupt``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Mapping, Optional, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_workflow.core import rundir
from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.train.hooks import PostCheckpointHook

log = logging.getLogger(__name__)

NO_RESUME = ("none", "false", "no", "")


class CheckpointError(FileNotFoundError):
    """``checkpoint.resume`` names something that is not a complete checkpoint, or one refused as unsafe."""


class CheckpointSaveError(OSError):
    """A save failed on a full disk: ``step-N.tmp`` was removed, the previous checkpoint is intact.

    Attributes:
        step: the step whose save failed.
        detail: the underlying error, e.g. ``[Errno 28] No space left on device: '.../__1_0.distcp'``.
    """

    def __init__(self, step: int, tmp: Path, detail: str) -> None:
        super().__init__(f"disk full while saving checkpoint step {step} into {tmp}: {detail}")
        self.step = step
        self.detail = detail


class Checkpointer(Protocol):
    """What the training loop asks of a checkpoint format; every rank calls each method."""

    def save(self, step: int, parts: Mapping[str, Stateful], *, blocking: bool = False) -> None:
        """Write ``parts`` as ``step-<step>`` (in the background when allowed and not ``blocking``)."""

    def load(self, path: Path, parts: Mapping[str, Stateful]) -> None:
        """Load the checkpoint at ``path`` into ``parts``, in place."""

    def poll(self) -> None:
        """Commit a finished background save without blocking (called once per step)."""

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""

    def close(self) -> None:
        """Wait for the post-checkpoint hook; call before the process exits."""


class CheckpointDir:
    """``RUN_DIR/checkpoints``: where saves are written, how they commit, what is pruned.

    Args:
        run: the run directory's layout.
        keep_last: ``checkpoint.keep_last`` (0 keeps all).
        rank: global rank; rank 0 alone renames, prunes and runs the hook.
    """

    def __init__(self, run: RunDir, keep_last: int, rank: int) -> None:
        self.run = run
        self.keep_last = keep_last
        self.rank = rank
        self.hook = PostCheckpointHook(run.post_checkpoint_hook, cwd=run.root)
        if rank == 0:
            run.checkpoints.mkdir(parents=True, exist_ok=True)

    def begin(self, step: int) -> Path:
        """Clear a ``step-N.tmp`` left by a crash and return it, once every rank got here."""
        tmp = self.run.step_tmp(step)
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        barrier()
        return tmp

    def commit(self, step: int) -> None:
        """Rank 0: rename ``step-N.tmp`` to ``step-N``, prune, run the hook. Every rank's files must be written."""
        if self.rank != 0:
            return
        final = self.run.step_dir(step)
        if final.exists():
            _remove_dir(final)
        os.replace(self.run.step_tmp(step), final)
        rundir.fsync_dir(self.run.checkpoints)
        # Which steps were saved, pruned ones included: evaluate tells a pruned step from one never saved.
        rundir.append_json_line(self.run.saves, {"step": step, "time": round(time.time(), 3)})
        # The previous hook may be hard-linking the step about to be pruned.
        self.hook.wait()
        self._prune()
        self.hook.start(step)

    def close(self) -> None:
        """Wait for the last hook (it may still need its checkpoint)."""
        self.hook.wait()

    def abandon(self, step: int) -> None:
        """Rank 0: remove a failed save's ``step-N.tmp`` (it is never a checkpoint; this frees its space)."""
        if self.rank == 0:
            shutil.rmtree(self.run.step_tmp(step), ignore_errors=True)

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, path in self.run.list_checkpoints()[:-self.keep_last]:
            _remove_dir(path)

    def resume_path(self, resume: str) -> Optional[Path]:
        """Where ``checkpoint.resume`` says to resume from (None: start fresh).

        Args:
            resume: ``auto`` (newest complete checkpoint), ``none``, or a ``step-N`` path.

        Raises:
            CheckpointError: ``resume`` is a path with no complete checkpoint.
        """
        r = (resume or "none").strip()
        if r.lower() in NO_RESUME:
            return None
        if r.lower() == "auto":
            return self.newest_whole()
        path = Path(r)
        if not rundir.is_complete_checkpoint(path):
            raise CheckpointError(
                f"checkpoint.resume={r!r} is not a complete checkpoint (no {rundir.DCP_METADATA} or DeepSpeed "
                f"'{rundir.DEEPSPEED_LATEST}' file). Use auto, none, or a complete "
                f"{rundir.CHECKPOINTS_DIR}/{rundir.STEP_PREFIX}N directory; complete ones "
                f"here: {[str(p) for _, p in self.run.list_checkpoints()]}"
            )
        return path


    def newest_whole(self) -> Optional[Path]:
        """The newest checkpoint that passes :func:`checkpoint_problem`; older ones are never touched.

        Rank 0 checks, newest first, and renames each one that fails to
        ``step-N.corrupt`` (never deletes it) with a warning naming it and why; the
        other ranks get rank 0's answer, so all load the same step.
        """
        chosen: list[Optional[str]] = [None]
        if self.rank == 0:
            for step, path in reversed(self.run.list_checkpoints()):
                problem = checkpoint_problem(path)
                if problem is None:
                    chosen[0] = str(path)
                    break
                aside = self.run.quarantine_path(step)
                os.replace(path, aside)
                rundir.fsync_dir(self.run.checkpoints)
                log.warning("skipping checkpoint %s: %s. Moved it to %s (kept for inspection); "
                            "resuming from an older one.", path, problem, aside)
        if dist.is_initialized():
            dist.broadcast_object_list(chosen, src=0)
        return Path(chosen[0]) if chosen[0] else None


def barrier() -> None:
    """``dist.barrier()`` when there is a process group (a single process has nothing to wait for)."""
    if dist.is_initialized():
        dist.barrier()


def _remove_dir(path: Path) -> None:
    """Rename out of the ``step-N`` namespace first, then delete: a crash never leaves half a ``step-N``."""
    trash = path.with_name(path.name + rundir.DELETING_SUFFIX)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
