"""Step 1 of a consolidation: resolve what the user pointed at into opened checkpoints.

:func:`resolve_source` walks from ``SRC`` to the checkpoint directories (:mod:`.layout`),
opens one :class:`~.reader.CheckpointSource` per directory (a DCP index, or a DeepSpeed
checkpoint rebuilt into a staging file) and reads the reference ``config.json``. Nothing
is written to the output yet, so every error here leaves the disk as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_workflow.core.paths import output_overlap

from .deepspeed import DeepSpeedCheckpoint
from .consolidation_errors import ConsolidationError
from .hf_assets import fixed_architectures, read_config
from .layout import Resolved, resolve, step_of
from .metadata import load_meta_pt
from .reader import CheckpointSource, DcpCheckpoint
from .jsontypes import JsonObject, PlainValue

log = logging.getLogger(__name__)

META_PT = "meta.pt"  # Lightning / NeMo trainer metadata beside the DCP files


@dataclass(frozen=True)
class Selection:
    """Which checkpoint(s) under ``SRC`` to take, as the user asked (checked by :mod:`.options`)."""

    step: int | None = None  # one step of a directory of step-N checkpoints
    average_last: int | None = None  # average the newest K complete steps
    steps: list[int] | None = None  # average these steps
    subtree: str | None = None  # key root or subdirectory to take the weights from ("ema")
    reference: Path | None = None  # HF model dir with config.json; None: found beside the checkpoint


@dataclass(frozen=True)
class Reference:
    """The Hugging Face model directory whose config and tokenizer go with the weights."""

    path: Path
    config: JsonObject  # its config.json
    architectures: list[str]  # config's ``architectures`` without FSDP2 class prefixes


@dataclass
class Source:
    """What :func:`resolve_source` found: opened checkpoints and the reference, ready to plan.

    Close it (:meth:`close`) when done: a DeepSpeed source holds a staging file.
    """

    layout: str  # "project", "dcp", "accelerate", "deepspeed", ... (see :mod:`.layout`)
    dirs: list[Path]  # one checkpoint directory per source, oldest first
    checkpoints: list[CheckpointSource]  # opened, in the order of ``dirs``
    subtree_key: str | None  # key root still to strip from tensor names
    reference: Reference | None
    meta_pt: dict[str, PlainValue] | None = None  # plain values of a Lightning meta.pt beside the last source
    notes: list[str] = field(default_factory=list)  # for verification.json, in the order they arose

    def close(self) -> None:
        """Close every opened checkpoint (removes DeepSpeed staging files)."""
        for checkpoint in self.checkpoints:
            checkpoint.close()


def resolve_source(src: Path, out: Path, selection: Selection) -> Source:
    """Resolve ``src`` to checkpoints, open them and read the reference config.

    Notes about skipped steps are printed to stderr at once (they explain a wait or a
    surprise before the copy starts) and kept in :attr:`Source.notes`.

    Args:
        src: What the user pointed at: a DCP directory or any directory above one.
        out: The output directory; DeepSpeed staging files go beside it.
        selection: Step choice, subtree and reference.

    Returns:
        The opened :class:`Source`; the caller closes it.

    Raises:
        ConsolidationError: No (complete, unique) checkpoint at ``src``, ``out`` inside a
            checkpoint read or holding one (:func:`check_apart`), a ``--reference`` without
            config.json, unreadable checkpoint files, or mixed formats.
    """
    return open_source(locate_source(src, out, selection), out)


def locate_source(src: Path, out: Path, selection: Selection) -> Resolved:
    """Find the checkpoint directories under ``src`` and check ``out`` against them; reads directories only.

    Raises:
        ConsolidationError: As :func:`resolve_source`, for everything but opening the files.
    """
    res = resolve(src, step=selection.step, average_last=selection.average_last, steps=selection.steps,
                  subtree=selection.subtree, reference=selection.reference)
    check_apart(src, out, res.dcp_dirs)
    return res


def open_source(res: Resolved, out: Path) -> Source:
    """Open the checkpoints :func:`locate_source` found and read the reference config.

    Raises:
        ConsolidationError: A ``--reference`` without config.json, unreadable checkpoint
            files, or mixed formats.
    """
    for note in res.notes:
        log.warning("note: %s", note)
    if res.reference is not None and not (res.reference / "config.json").is_file():
        raise ConsolidationError(f"--reference {res.reference}: no config.json there; point at a Hugging Face model directory")
    checkpoints = open_checkpoints(res.layout, res.dcp_dirs, out)
    try:
        reference = None
        notes = list(res.notes)
        if res.reference is not None:
            config = read_config(res.reference)
            architectures, arch_notes = fixed_architectures(config)
            reference = Reference(res.reference, config, architectures)
            notes += arch_notes
        meta_pt, meta_note = read_meta_pt(res.dcp_dirs[-1] / META_PT)
        if meta_note:
            notes.append(meta_note)
    except BaseException:
        for checkpoint in checkpoints:
            checkpoint.close()
        raise
    return Source(res.layout, res.dcp_dirs, checkpoints, res.subtree_key, reference, meta_pt, notes)


def check_apart(src: Path, out: Path, dcp_dirs: list[Path]) -> None:
    """Refuse an ``out`` inside a checkpoint directory read, or holding one: the planner's rule (:mod:`fsdp_workflow.core.paths`).

    Checked against the directories actually read, and against the directory of ``step-N``
    checkpoints above each (pruning and step discovery read every entry there), not against
    ``src`` itself: ``SRC=RUN_DIR OUT=RUN_DIR/hf_model`` is the usual layout and is allowed.
    ``SRC SRC/out --remove-sharded`` would otherwise delete the model with the shards.

    Raises:
        ConsolidationError: naming OUT, the checkpoint directory and SRC.
    """
    roots: list[Path] = []
    for d in dcp_dirs:
        roots.append(d)
        if step_of(d.name) is not None:
            roots.append(d.parent)
    for root in roots:
        why = output_overlap(out, root)
        if why:
            raise ConsolidationError(
                f"OUT {out} {why} (SRC {src}). Choose an OUT outside the checkpoints, e.g. a directory beside "
                f"{root}; nothing was written")


def open_checkpoints(layout: str, dirs: list[Path], out: Path) -> list[CheckpointSource]:
    """One reader per directory: DCP directories, or DeepSpeed tag directories (rebuilt from ZeRO partitions).

    Args:
        layout: The layout :func:`~.layout.resolve` named.
        dirs: The checkpoint directories.
        out: The output directory; DeepSpeed staging files go in its parent.

    Returns:
        The opened sources, in the order of ``dirs``.

    Raises:
        ConsolidationError: The directories mix formats, or one cannot be read.
    """
    if layout == "mixed":
        raise ConsolidationError(f"{dirs}: the chosen steps mix checkpoint formats (DCP and DeepSpeed); pick steps of one format")
    if layout != "deepspeed":
        return [DcpCheckpoint(d) for d in dirs]
    out.parent.mkdir(parents=True, exist_ok=True)
    opened: list[CheckpointSource] = []
    try:
        for d in dirs:
            opened.append(DeepSpeedCheckpoint(d, out.parent))
    except BaseException:
        for checkpoint in opened:
            checkpoint.close()
        raise
    return opened


def read_meta_pt(path: Path) -> tuple[dict[str, PlainValue] | None, str | None]:
    """Plain values of a Lightning/NeMo ``meta.pt``; it is optional, so one that cannot be read becomes a note.

    Args:
        path: Where a ``meta.pt`` would be.

    Returns:
        (its int/float/str/bool values, None), (None, a note saying why it was skipped),
        or (None, None) when there is none.
    """
    if not path.is_file():
        return None, None
    try:
        info = load_meta_pt(path)
    except (ConsolidationError, OSError) as exc:  # refused or unreadable: the weights do not depend on it
        return None, (
            f"{path}: could not be read, so it was skipped ({exc}). It is optional trainer metadata (step, "
            "hyper-parameters); the weights come from '.metadata' and the .distcp shards. Nothing in it was executed."
        )
    return {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))}, None
