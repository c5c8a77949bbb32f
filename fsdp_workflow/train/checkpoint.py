"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout (a contract with the consolidator)::

    RUN_DIR/checkpoints/step-N/        a complete checkpoint: .metadata + __<rank>_0.distcp per rank
    RUN_DIR/checkpoints/step-N.tmp     being written (or left by a crash): ignored by every reader
    RUN_DIR/hf_assets/                 config.json, generation_config.json, tokenizer files (written once)

The saved state dict is ``{"model", "optimizer", "scheduler", "trainer"}``: the
model and optimizer come from ``get_state_dict`` (fully qualified names, FSDP2
DTensor shards, reshardable on load), so DCP keys read
``model.model.layers.0.self_attn.q_proj.weight``. ``trainer`` holds the step and
the data position as plain ints.

Atomicity: every rank writes into ``step-N.tmp``; DCP's coordinator writes
``.metadata`` only after gathering all ranks' results; then rank 0 renames the
directory to ``step-N``. A crash at any point leaves at most a ``*.tmp``.
Pruning renames ``step-N`` away before deleting it, so a crash while pruning never
leaves a half-deleted ``step-N``.

Loading never unpickles arbitrary objects: ``.metadata`` goes through an
allow-list unpickler (DCP's ``FileSystemReader`` uses plain ``pickle.load``, and
``checkpoint.resume`` may name a directory someone else wrote), and non-tensor items
(ints, floats, lists, the optimizer's param groups) are read with
``torch.load(weights_only=True)`` (DCP's default planner uses ``weights_only=False``).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_workflow.config.schema import CheckpointConfig

STEP_RE = re.compile(r"^step-(\d+)$")
# Test hook: seconds to sleep after the shards are written and before .metadata
# and the rename, so a test can kill -9 the job in the middle of a save.
SAVE_DELAY_ENV = "FSDP_WORKFLOW_TEST_SAVE_DELAY_S"


class CheckpointError(FileNotFoundError):
    """``checkpoint.resume`` names something that is not a complete checkpoint."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP load planner whose non-tensor items go through ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` naming only its own classes, torch dtypes and sizes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a DCP .metadata file (a crafted checkpoint?); "
            "refusing to load it"
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if hasattr(self, "_get_metadata_path"):  # torch >= 2.8 (per-rank metadata files)
            path = self._get_metadata_path(kwargs.get("rank"))
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _DelayedWriter(FileSystemWriter):
    """FileSystemWriter that pauses before writing ``.metadata`` (tests only)."""

    def __init__(self, *args: Any, delay_s: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._delay_s = delay_s

    def finish(self, metadata: Any, results: Any) -> None:
        time.sleep(self._delay_s)
        super().finish(metadata, results)


def is_complete(path: Path) -> bool:
    """A DCP checkpoint has ``.metadata``; a DeepSpeed one has its ``latest`` tag file."""
    return (path / ".metadata").is_file() or (path / "latest").is_file()


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (``step-<int>`` directories), oldest first."""
    out = []
    if ckpt_dir.is_dir():
        for p in ckpt_dir.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and is_complete(p):
                out.append((int(m.group(1)), p))
    return sorted(out)


class Checkpointer:
    """Save, prune and find DCP checkpoints under ``RUN_DIR/checkpoints``.

    Args:
        run_dir: the run directory.
        cfg: the ``checkpoint`` group.
        rank: global rank (rank 0 renames and prunes).
        async_group: a separate gloo group for ``async_save`` (its background
            collectives must not interleave with training's on the default group).
    """

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, rank: int, async_group: Any = None):
        self.dir = Path(run_dir) / "checkpoints"
        self.cfg = cfg
        self.rank = rank
        self.async_group = async_group
        self._pending: Optional[tuple[Any, int, Path]] = None  # (future, step, tmp)
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ find
    def resume_path(self) -> Optional[Path]:
        """Where ``checkpoint.resume`` says to resume from (None: start fresh).

        Raises:
            CheckpointError: ``resume`` is a path with no complete checkpoint.
        """
        r = (self.cfg.resume or "none").strip()
        if r.lower() in ("none", "false", "no", ""):
            return None
        if r.lower() == "auto":
            found = list_checkpoints(self.dir)
            return found[-1][1] if found else None
        p = Path(r)
        if not is_complete(p):
            raise CheckpointError(
                f"checkpoint.resume={r!r} is not a complete checkpoint (no .metadata). Use auto, none, "
                f"or a RUN_DIR/checkpoints/step-N directory; complete ones here: "
                f"{[str(q) for _, q in list_checkpoints(self.dir)]}"
            )
        return p

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], *, blocking: bool = False) -> None:
        """Write ``state`` as ``step-<step>``; asynchronously if ``checkpoint.async_save`` and not ``blocking``.

        Every rank must call this with the same ``step``.
        """
        self.wait()  # one save in flight at a time
        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # left by a crash
        dist.barrier()
        delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
        if delay > 0:
            writer: FileSystemWriter = _DelayedWriter(tmp, delay_s=delay)
        else:
            writer = FileSystemWriter(tmp)
        if self.cfg.async_save and not blocking:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.async_group)
            self._pending = (fut, step, tmp)
            return
        dcp.save(state, storage_writer=writer)
        self._commit(step, tmp, final)
        dist.barrier()

    def save_deepspeed(self, step: int, engine: Any, client_state: dict[str, Any]) -> None:
        """DeepSpeed's own format (``engine.save_checkpoint``) under the same tmp-then-rename scheme.

        ``step-N/`` then holds ``latest`` and ``global_stepN/`` (model and ZeRO
        optimizer partitions), which DeepSpeed's ``zero_to_fp32`` and the
        consolidator read. ``client_state`` carries the trainer and scheduler state.
        """
        self.wait()
        final, tmp = self.dir / f"step-{step}", self.dir / f"step-{step}.tmp"
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        engine.save_checkpoint(str(tmp), tag=f"global_step{step}", client_state=client_state)
        dist.barrier()  # every rank's partition is on disk
        self._commit(step, tmp, final)
        dist.barrier()

    @staticmethod
    def load_deepspeed(path: Path, engine: Any) -> dict[str, Any]:
        """Load a DeepSpeed checkpoint into ``engine``; return its client state.

        DeepSpeed's loader unpickles its files with ``weights_only=False``, so every file
        is first read with the consolidator's restricted loader, and the load is refused
        unless all of them hold only tensors and DeepSpeed's plain records.
        """
        check_deepspeed_pickles(path)
        _, client_state = engine.load_checkpoint(str(path))
        if client_state is None:
            raise CheckpointError(f"{path}: DeepSpeed could not load this checkpoint")
        return client_state

    def poll(self) -> None:
        """Commit a finished async save without blocking (call once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written, then commit it."""
        if self._pending is None:
            return
        fut, step, tmp = self._pending
        self._pending = None
        fut.result()
        self._commit(step, tmp, self.dir / f"step-{step}")

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        if self.rank != 0:
            return
        # DCP's coordinator writes .metadata after all ranks reported their writes:
        # when rank 0's save returns, the whole checkpoint is on disk.
        if final.exists():
            _remove_dir(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        # consolidate.every_checkpoint: a no-op unless the planner wrote submit_eval.sh
        from fsdp_workflow.launch.eval_jobs import submit_checkpoint_eval

        submit_checkpoint_eval(self.dir.parent, step)
        self._prune()

    def _prune(self) -> None:
        keep = self.cfg.keep_last
        if keep <= 0:
            return
        for _, path in list_checkpoints(self.dir)[:-keep]:
            _remove_dir(path)

    # ------------------------------------------------------------------ load
    @staticmethod
    def load(path: Path, state: dict[str, Any]) -> None:
        """Load ``path`` into ``state`` in place (tensors, DTensors resharded as needed)."""
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())


def check_deepspeed_pickles(path: Path) -> None:
    """Refuse a DeepSpeed checkpoint whose ``*.pt`` files hold anything but tensors and plain records.

    Raises:
        CheckpointError: naming the file; nothing in it was executed.
    """
    from fsdp_workflow.consolidate.deepspeed import load_safely
    from fsdp_workflow.consolidate.errors import ConsolidationError

    files = sorted(Path(path).rglob("*.pt"))
    if not files:
        raise CheckpointError(f"{path}: no DeepSpeed *.pt files here; not a complete DeepSpeed checkpoint")
    for f in files:
        try:
            load_safely(f)
        except ConsolidationError as exc:
            raise CheckpointError(f"refusing to resume: {exc}") from None


def _remove_dir(path: Path) -> None:
    """Rename out of the ``step-<int>`` namespace first, then delete."""
    trash = path.with_name(f"{path.name}.deleting")
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_hf_assets(run_dir: Path, model: Any, tokenizer: Any) -> Path:
    """Write ``config.json``, ``generation_config.json`` and the tokenizer to ``RUN_DIR/hf_assets`` once.

    Call on rank 0 only. Written to a temporary directory and renamed, so the
    consolidator never sees half of it.
    """
    from transformers import GenerationConfig

    dest = Path(run_dir) / "hf_assets"
    if (dest / "config.json").is_file():
        return dest
    tmp = dest.with_name("hf_assets.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config = model.config
    use_cache = getattr(config, "use_cache", None)
    config.use_cache = True  # inference default for the consolidated model
    try:
        config.save_pretrained(tmp)
    finally:
        config.use_cache = use_cache
    gen = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(config)
    gen.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest
