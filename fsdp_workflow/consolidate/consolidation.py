"""The :func:`consolidate` entry point: sharded checkpoint(s) -> verified HF model dir.

It is the composition of the typed steps in :mod:`.source` and :mod:`.steps`: check the
options, resolve the source, plan the files, write, verify, commit.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_workflow.core.exit_codes import DISK_FULL_ERRNOS, EXIT_INTERRUPTED
from fsdp_workflow.core.interrupts import stopped_by
from fsdp_workflow.core.lock import Lock, LockHeld, LockUnsupported, acquire
from fsdp_workflow.core.rundir import list_checkpoints, parse_step

from . import in_place as inplace
from .casting import CLI_DTYPES
from .consolidation_errors import ConsolidationError, ConsolidationInterrupted, OutputExistsError
from .options import check_options, out_exists_problem
from .source import Selection, locate_source, open_source
from .verify.report_schema import VerificationReport
from .steps import (
    WriteSettings,
    commit_output,
    deferred_interrupt,
    plan_output,
    remove_sources,
    staging_dir,
    verify_output,
    write_output,
)

log = logging.getLogger(__name__)


@dataclass
class ConsolidationResult:
    """What :func:`consolidate` produced."""

    output: Path  # the model directory
    num_tensors: int
    num_bytes: int  # tensor bytes written
    files: list[str]  # safetensors file names, in order
    layout: str  # the source layout recognised ("project", "dcp", "deepspeed", ...)
    sources: list[Path]  # the checkpoint directories read
    verification: VerificationReport  # also written to OUT/verification.json
    seconds: float = 0.0


def consolidate(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    step: int | None = None,
    average_last: int | None = None,
    steps: list[int] | None = None,
    weights: list[float] | None = None,
    subtree: str | None = None,
    reference: str | os.PathLike[str] | None = None,
    remove_sharded: bool = False,
    verify: bool = True,
    full_verify: bool = False,
    progress: bool = True,
    workers: int | None = None,
    from_pretrained_max_bytes: int = 256 << 20,
    overwrite: bool = False,
    allow_nonfinite: bool = False,
) -> ConsolidationResult:
    """Consolidate a sharded DCP (or DeepSpeed) checkpoint into a Hugging Face model directory.

    Args:
        src: A DCP directory, or any directory above one (run dir, ``checkpoints/``,
            ``checkpoint-N/``, an Accelerate output dir); see :mod:`.layout`.
        out: Output directory; must not exist (or be empty) unless ``overwrite``. Written as a temporary
            sibling and renamed; it may not lie inside a checkpoint directory read, nor hold
            one (:func:`fsdp_workflow.core.paths.output_overlap`, the planner's rule). A lock
            file beside it (``.OUT.consolidate.lock``) keeps a second consolidation into it out.
            An existing ``out`` that cannot be renamed (a mount point) is replaced in place,
            lock and staging inside it (:mod:`.in_place`).
        dtype: ``None`` keeps stored dtypes; ``"bf16"``, ``"fp16"`` or ``"fp32"`` casts
            floating tensors only.
        max_shard_size: Split output files past this size (``"5GB"``, ``"1TB"``, ``"2GiB"``,
            bytes as int), parsed by :func:`fsdp_workflow.core.sizes.parse_size`.
        step: Pick step N from a directory of ``step-N`` checkpoints (default: the newest
            one with ``.metadata``; newer incomplete ones are skipped with a note).
        average_last: Average the last K complete steps.
        steps: Average these steps.
        weights: Weights for averaging (normalised to sum to 1; default equal).
        subtree: A key root (``"ema"``) or a subdirectory name to take weights from.
        reference: HF model dir for config/tokenizer; found automatically when the
            checkpoint sits in a run dir with ``hf_assets/`` or beside ``config.json``.
        remove_sharded: Delete the source DCP directories after verification passed
            (refused with ``verify=False``).
        verify: Run verification (the files parsed with safetensors, values against the
            checkpoint, architecture, loading).
        full_verify: Compare every byte of every tensor (always so with ``remove_sharded``);
            by default every tensor is compared at its chunk boundaries and on a fixed
            fraction of its bytes (see docs/consolidation.md, Verification).
        progress: Show a tqdm progress bar on stderr.
        workers: Copy/verify threads (default ``min(8, 2 * cpu_count)``).
        from_pretrained_max_bytes: Load the result with ``from_pretrained`` when smaller.
        overwrite: Replace an existing ``out`` (an earlier output of this tool or any other
            directory; never a file or symlink) once the new model is verified.
        allow_nonfinite: Write weights holding NaN or inf (else refused, nothing written);
            verification.json and the model card then name the tensors.

    Returns:
        A :class:`ConsolidationResult`; ``verification`` is also written to
        ``OUT/verification.json``.

    Raises:
        ConsolidationError: For anything the user can fix (bad options are all reported
            at once, see :mod:`.options`); nothing is left at ``out``. Subclasses:
            :class:`~.errors.OutputExistsError` (``out`` exists), and
            :class:`~.nonfinite.NonFiniteWeightsError` (NaN/inf weights).
        ConsolidationInterrupted: Ctrl-C; its message says what is left (nothing partial).
    """
    t0 = time.time()
    out = Path(out)
    max_bytes = check_options(out, dtype=dtype, max_shard_size=max_shard_size, step=step, average_last=average_last,
                              steps=steps, weights=weights, remove_sharded=remove_sharded, verify=verify, workers=workers,
                              overwrite=overwrite)
    committed = removed = False
    located = None
    try:
        selection = Selection(step, average_last, steps, subtree, Path(reference) if reference else None)
        located = locate_source(Path(src), out, selection)  # OUT apart from the checkpoints before the lock file is made
        # An existing OUT that cannot be renamed (a mount point) is replaced in place: lock and staging inside it
        # (an existing one is written at all only with --overwrite, or when empty: options.out_exists_problem).
        in_place = inplace.cannot_rename(out)
        lock = _lock_output(out, inside=in_place is not None)
        with lock:
            _remove_dead_staging(out, locked=not isinstance(lock, contextlib.nullcontext), inside=in_place is not None)
            problem = out_exists_problem(out, overwrite)  # again, under the lock: an earlier holder may have written it
            if problem:
                raise OutputExistsError(problem)
            # DeepSpeed's rebuilt tensors are staged beside the model's staging directory: inside OUT when in place
            source = open_source(located, inplace.staging_path(out) if in_place else out)
            if in_place:
                note = (f"OUT {out} cannot be renamed ({in_place}): the model was written into it in place, "
                        f"{inplace.VERIFICATION_FILE} last (docs/consolidation.md, 'An OUT that cannot be renamed')")
                log.warning("note: %s", note)
                source.notes.append(note)
            try:
                out_dtype = CLI_DTYPES[dtype] if dtype is not None else None
                plan = plan_output(source, out_dtype=out_dtype, weights=weights, max_shard_bytes=max_bytes)
                settings = WriteSettings(workers or min(8, 2 * (os.cpu_count() or 1)), verify, progress, out_dtype,
                                         weights, full_verify or remove_sharded,  # shards deleted only once every byte compared
                                         allow_nonfinite)
                check_space(out, plan.total_bytes)
                try:
                    with staging_dir(out, inplace.staging_path(out) if in_place else None) as staging:
                        written = write_output(source, plan, staging, settings)
                        report = verify_output(source, plan, written, verify=verify,
                                               from_pretrained_max_bytes=from_pretrained_max_bytes)
                        with deferred_interrupt():  # Ctrl-C waits for the renames, then says OUT was written
                            commit_output(staging, out, report, source, replace=overwrite,
                                          in_place=in_place is not None)
                            committed = True
                except OSError as exc:
                    if exc.errno not in DISK_FULL_ERRNOS:
                        raise
                    raise ConsolidationError(
                        f"{out}: the disk filled while writing the model ([Errno {exc.errno}] {exc.strerror}); the "
                        f"partial output was removed and the checkpoint is untouched. Free space, or write elsewhere "
                        f"(about {plan.total_bytes} bytes are needed)") from None
            finally:
                source.close()  # DeepSpeed staging files
            if remove_sharded:
                with deferred_interrupt():  # never half a checkpoint deleted
                    remove_sources(source, report)
                    removed = True
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM where the CLI made it one (core.interrupts)
        word = stopped_word()
        if committed:
            raise ConsolidationInterrupted(
                f"{word}: {out} was written and verified before the interrupt"
                + ("" if not remove_sharded else "; the sharded checkpoint was removed as asked" if removed
                   else "; the sharded checkpoint was kept (--remove-sharded did not run)")) from None
        raise ConsolidationInterrupted(
            f"{word}: nothing was written to {out} (the partial output was removed); the checkpoint is "
            "untouched") from None
    except FileNotFoundError as exc:  # a checkpoint removed while it was read: training pruned it
        pruned = _pruned_checkpoint(exc, located.dcp_dirs if located is not None else [], out)
        if pruned is None:
            raise
        raise ConsolidationError(pruned) from None
    return ConsolidationResult(out, len(plan.tensors), plan.total_bytes, [f.name for f in plan.files], source.layout,
                               source.dirs, report, time.time() - t0)


def stopped_word() -> str:
    """How the message of a stopped consolidation starts: ``interrupted`` (Ctrl-C) or ``terminated (SIGTERM)``."""
    return "interrupted" if stopped_by()[0] == EXIT_INTERRUPTED else stopped_by()[1]


def _remove_dead_staging(out: Path, locked: bool, inside: bool = False) -> None:
    """Remove the staging directories (``.OUT.tmp-PID``) of consolidations into ``out`` that were killed.

    A SIGKILL (the OOM killer, ``kill -9``, a scheduler past its grace) leaves the
    model's size there, which nothing else removes. Under OUT's lock no other
    consolidation into OUT is running, so a staging directory whose process is gone
    is a leftover. A live process of that pid (a reused pid, or a writer on another
    node where the lock is per node) keeps its directory; without the lock none is removed.
    With ``inside`` (OUT replaced in place) they are ``OUT/.consolidate-tmp-PID`` and
    ``OUT/.consolidate-old-PID`` (:mod:`.in_place`).
    """
    prefix = f".{out.name}.tmp-"  # steps.staging_dir's name: .OUT.tmp-PID
    found = ([(path, path.name[len(prefix):]) for path in sorted(out.parent.glob(glob.escape(prefix) + "*"))]
             if out.parent.is_dir() else [])
    for path, pid in inplace.leftovers(out) if inside else found:
        if pid == str(os.getpid()) or not pid.isdigit() or not path.is_dir():
            continue
        if not locked:
            log.warning("note: %s is the staging directory of another consolidation into %s (pid %s); without "
                        "the lock it is left in place: remove it once no consolidation into %s runs", path, out,
                        pid, out)
            continue
        if _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("note: removed %s, left by a consolidation into %s that was killed (pid %s is gone)",
                    path, out, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _pruned_checkpoint(exc: FileNotFoundError, dirs: list[Path], out: Path) -> str | None:
    """The message for a checkpoint directory removed while it was read (None: the missing file is not in one)."""
    missing = Path(str(exc.filename or ""))
    gone = next((d for d in dirs if missing == d or d in missing.parents), None)
    if gone is None:
        return None
    step = next((p for p in (gone, *gone.parents) if parse_step(p.name) is not None), gone)
    kept = [path.name for _, path in list_checkpoints(step.parent)] if step.parent.is_dir() else []
    return (f"{step}: the checkpoint was removed while it was being read ({missing}: no such file). Training "
            f"removes older checkpoints as it saves new ones (checkpoint.keep_last), or something else deleted "
            f"it. Nothing was written to {out} (the partial output was removed). "
            + (f"The checkpoints in {step.parent} now: {', '.join(kept)}; consolidate one that training keeps "
               "(the newest is the default step), or consolidate once the run has ended, or give the run a larger "
               "checkpoint.keep_last" if kept else
               f"No complete checkpoint is left in {step.parent}; consolidate once the run has saved one"))


def lock_path(out: Path) -> Path:
    """The lock file of an output directory: ``OUT.parent/.OUT.consolidate.lock``, beside it (OUT itself appears only at the end)."""
    return out.parent / f".{out.name}.consolidate.lock"


def _lock_output(out: Path, inside: bool = False) -> contextlib.AbstractContextManager[object]:
    """Take the output's lock, or refuse naming its holder; on a filesystem without ``flock``, warn and go on.

    With ``inside`` (OUT replaced in place, :mod:`.in_place`) the lock file is ``OUT/.consolidate.lock``,
    removed again when the consolidation ends.
    """
    try:
        lock = acquire(inplace.lock_file(out) if inside else lock_path(out), "consolidating", subject=f"OUT {out}")
    except LockHeld as exc:
        raise ConsolidationError(f"{exc} Two consolidations into one OUT are refused; nothing was written.") from None
    except LockUnsupported as exc:
        log.warning("note: %s; consolidating without the lock that keeps a second consolidation into %s out", exc, out)
        return contextlib.nullcontext()
    if not inside:
        return lock
    if not inplace.owns(lock):  # the file was removed by a holder finishing as we opened it: theirs, not ours
        lock.release()
        raise ConsolidationError(f"OUT {out}: another consolidation into it was finishing as this one started; "
                                 "nothing was written. Run the command again")
    return _InsideLock(lock)


class _InsideLock(contextlib.AbstractContextManager):
    """OUT's own lock (:mod:`.in_place`): the file is removed from OUT, then released."""

    def __init__(self, lock: Lock) -> None:
        self.lock = lock

    def __exit__(self, *exc: object) -> None:
        inplace.release(self.lock)



def check_space(out: Path, need: int) -> None:
    """Refuse before writing when the filesystem that will hold ``out`` has less free space than the weights need.

    The copy would otherwise fail part-way (and be cleaned up) after minutes of work. A
    quota (EDQUOT) is not visible here; the write-time error then says the same thing.

    Raises:
        ConsolidationError: naming the directory, the bytes free and the bytes needed.
    """
    where = out if out.is_dir() else out.parent  # an existing OUT may be a filesystem of its own (a mount point)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConsolidationError(
            f"{out}: [Errno {errno.ENOSPC}] No space left on device: {where} has {free} bytes free and the "
            f"model's weights need {need}. Free space or choose another output directory; nothing was written.")
