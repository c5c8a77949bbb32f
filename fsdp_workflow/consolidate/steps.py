"""Steps 2-5 of a consolidation: plan the files, write them, verify them, commit them.

Each step is a function from typed inputs to a small dataclass, so :func:`~.api.consolidate`
reads as their composition and each can be tested alone:

    source  = resolve_source(src, out, selection)                      # .source
    plan    = plan_output(source, out_dtype, weights, max_shard_bytes)  # names, dtypes, file layout
    written = write_output(source, plan, staging, settings)             # safetensors, index, config, assets
    report  = verify_output(source, plan, written, ...)                 # verification.json's content
    commit_output(staging, out, report, source)                         # verification.json, rename

Everything is written into a temporary sibling of ``out`` (:func:`staging_dir`), which is
renamed only once verification passed, so ``out`` never holds a half-written model.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .average import normalise_weights
from .casting import FLOAT_NAMES
from .deepspeed import DeepSpeedCheckpoint
from .consolidation_errors import ConsolidationError
from .hf_assets import copy_assets, copy_licenses, dominant_float_dtype, index_metadata, index_text, write_config
from .hub_layout import hub_pieces
from .in_place import commit_in_place
from .key_names import TiedPair, map_keys, tied_pair
from .nonfinite import BadCount, NonFiniteScan, describe, refusal
from .source import Source
from .verify.architecture import ArchitectureCheck, ArchResult, record_architecture, record_loading
from .verify.reference_names import names_note
from .verify.report_schema import VerificationReport
from .writer import OutFile, OutTensor, StreamingWriter, plan_files, source_digest
from fsdp_workflow.core.logs import is_terminal
from fsdp_workflow.core.modeldir import INDEX_FILE, VERIFICATION_FILE

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .verify.verifier import Outcome, Verifier



@dataclass
class OutputPlan:
    """Step 2's result: every output tensor, its dtype and sources, and the file layout."""

    tensors: list[OutTensor]
    files: list[OutFile]
    total_bytes: int
    dtype: str  # the floating dtype holding most bytes: config.json's ``torch_dtype``
    tied: TiedPair | None
    notes: list[str] = field(default_factory=list)  # the expert layout written (:mod:`.hub_layout`), for verification.json


@dataclass(frozen=True)
class WriteSettings:
    """How to write: threads, whether to verify beside the copy, whether to show a progress bar.

    ``out_dtype`` and ``weights`` are what the user asked for (not the plan's reading of it):
    the verifier derives the expected output from them and the checkpoint on its own.
    """

    workers: int
    verify: bool
    progress: bool
    out_dtype: str | None = None  # cast floating tensors to this (None: keep)
    weights: list[float] | None = None  # averaging weights as given (None: equal)
    full_verify: bool = False  # compare every byte (else fast mode: a fixed fraction plus every chunk boundary)
    allow_nonfinite: bool = False  # write NaN/inf weights on purpose (else refuse, nothing written)


@dataclass
class Written:
    """Step 3's result: what is in the staging directory, and the checks that ran beside the copy."""

    directory: Path
    tied_identical: bool | None  # the dropped tied tensor equalled the kept one (None: no tied pair)
    assets_copied: list[str]  # tokenizer and generation files taken from the reference
    architectures: list[str]  # as written to config.json
    architecture: ArchResult | None  # expected keys, computed in the background (verify + reference only)
    outcome: Outcome | None = None  # the independent comparison with the checkpoint (verify only)
    nonfinite: dict[str, BadCount] = field(default_factory=dict)  # tensors holding NaN/inf (only with allow_nonfinite)


def plan_output(source: Source, *, out_dtype: str | None, weights: list[float] | None,
                max_shard_bytes: int) -> OutputPlan:
    """Name the output tensors, pick their dtypes and sources, and lay out the files.

    Args:
        source: The opened checkpoints (several when averaging).
        out_dtype: Cast floating tensors to this dtype; None keeps the stored dtypes.
        weights: Averaging weights, one per checkpoint (None: equal).
        max_shard_bytes: Start a new safetensors file past this size.

    Returns:
        The :class:`OutputPlan`; nothing is read or written yet beyond the checkpoints' indexes.

    Raises:
        ConsolidationError: No model keys, checkpoints of different models, or shard
            files that are missing or shorter than their metadata says.
    """
    ckpts = source.checkpoints
    archs = source.reference.architectures if source.reference else []
    causal = (not archs) or any(a.endswith("ForCausalLM") for a in archs)
    mappings = [map_keys(list(c.tensors), source.subtree_key, causal) for c in ckpts]
    names = list(mappings[-1])
    for c, m in zip(ckpts, mappings):
        if set(m) != set(names):
            diff = sorted(set(m) ^ set(names))[:5]
            raise ConsolidationError(f"{c.path}: its model keys differ from {ckpts[-1].path} (e.g. {diff}); cannot average different models")
    for c, m in zip(ckpts, mappings):
        c.check_files(list(m.values()))
    newest = {n: ckpts[-1].tensors[mappings[-1][n]] for n in names}
    config = source.reference.config if source.reference else None
    tied = tied_pair(names, config, newest)
    w = normalise_weights(weights, len(ckpts)) if len(ckpts) > 1 or weights else None
    layout = hub_pieces({n: newest[n].shape for n in names if not (tied and n == tied.dropped)}, config)
    tensors = []
    for p in layout.pieces:
        srcs = [c.tensors[m[p.source]] for c, m in zip(ckpts, mappings)]
        if not p.whole:  # an expert of a fused tensor (hub_layout): its box of each source
            srcs = [s.select(p.index, p.rows or (0, s.shape[len(p.index)])) for s in srcs]
        keep = srcs[-1].dtype
        dt = out_dtype if (out_dtype and keep in FLOAT_NAMES) else keep
        tensors.append(OutTensor(p.name, srcs, dt, w if len(srcs) > 1 else None))
    bytes_by_dtype: dict[str, int] = {}
    for t in tensors:
        bytes_by_dtype[t.dtype] = bytes_by_dtype.get(t.dtype, 0) + t.nbytes
    return OutputPlan(tensors, plan_files(tensors, max_shard_bytes), sum(t.nbytes for t in tensors),
                      dominant_float_dtype(bytes_by_dtype), tied, layout.notes)


@contextmanager
def staging_dir(out: Path, inside: Path | None = None) -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` to write into; removed if anything fails before the commit.

    Args:
        out: The final output directory.
        inside: Stage here instead (OUT replaced in place: ``OUT/.consolidate-tmp-PID``, :mod:`.in_place`).

    Yields:
        The empty staging directory (``.OUT.tmp-PID``, or ``inside``).
    """
    tmp = inside or out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_output(source: Source, plan: OutputPlan, staging: Path, settings: WriteSettings) -> Written:
    """Write the model into ``staging``: safetensors files, their index, config.json and tokenizer files.

    The architecture check (with verification and a reference) and the tied-weight digests
    run in background threads during the copy; the comparison of each written tensor with
    the checkpoint (:class:`~.verify.verifier.Verifier`) runs beside the copy or after it
    (:func:`_build_verifier`).

    Args:
        source: The opened checkpoints and reference.
        plan: From :func:`plan_output`.
        staging: An empty directory (:func:`staging_dir`).
        settings: Threads, verification, progress bar.

    Every slab the writer assembles is scanned for NaN and inf (:mod:`.nonfinite`) before it
    is written; with any found and ``settings.allow_nonfinite`` off, the verification is
    abandoned and :class:`~.nonfinite.NonFiniteWeightsError` raised (the caller removes the
    staging directory).

    Returns:
        What was written, with the background results.

    Raises:
        ConsolidationError: A shard does not hold what its metadata says.
        NonFiniteWeightsError: The weights hold NaN or inf and they were not allowed.
        OSError: The output cannot be written (disk full, permissions).
    """
    ref = source.reference
    arch_check = ArchitectureCheck(ref.path, ref.architectures) if (settings.verify and ref) else None
    if arch_check:
        arch_check.start()
    tied = plan.tied
    verifier = _build_verifier(source, staging, settings) if settings.verify else None
    scan = NonFiniteScan()
    with ThreadPoolExecutor(max_workers=2) as side:
        digests = [side.submit(source_digest, s) for s in (tied.dropped_source, tied.kept_source)] if tied else []
        bar = (_Bar(plan.total_bytes) if is_terminal() else _LogProgress(plan.total_bytes)) if settings.progress else None
        side.submit(_warm_imports, ("xxhash",) if verifier else ())
        try:
            StreamingWriter(staging, plan.files, settings.workers, bar, verifier.written if verifier else None,
                            scan.scan).run()
            bad = scan.found()
            if bad and not settings.allow_nonfinite:
                raise refusal(bad, str(source.dirs[-1]), settings.out_dtype)
        except BaseException:
            if verifier:
                verifier.close()
            raise
        finally:
            if bar:
                bar.close()
        tied_identical = digests[0].result() == digests[1].result() if digests else None
    if len(plan.files) > 1:
        metadata = index_metadata((t.sources[0].numel, t.nbytes) for t in plan.tensors)
        weight_map = {t.name: plan.files[t.file_index].name for t in plan.tensors}
        (staging / INDEX_FILE).write_text(index_text(metadata, weight_map))  # as transformers' save_pretrained
    outcome = verifier.finish() if verifier else None
    arch = arch_check.result() if arch_check else None
    archs = ref.architectures if ref else []
    if arch and arch.architecture:  # a wrapper class name resolved from model_type
        archs = [arch.architecture]
    copied: list[str] = []
    if ref is not None:
        copied = copy_assets(ref.path, staging, ref.config)
        write_config(ref.config, staging, archs, plan.dtype)
    copied += copy_licenses([ref.path] if ref else [], staging)  # hf_assets/ keeps the base model's licences
    return Written(staging, tied_identical, copied, archs, arch, outcome, bad)


def _build_verifier(source: Source, staging: Path, settings: WriteSettings) -> Verifier:
    """Derive the expected output (:class:`~.verify.verifier.Verifier`, a few milliseconds: no numpy) and pick its schedule.

    Where the machine has CPUs to spare (:data:`OVERLAP_MIN_CPUS`), each tensor is compared
    as soon as it is written; on fewer, the writer's threads keep every CPU busy and a
    comparison running beside them slowed the copy by more than its own cost (2 CPUs,
    1.5 GB: 0.65-0.67 s against 0.61-0.63 s for comparing after the copy), so the writer's
    messages then only check where it wrote, and the comparisons start when the copy is
    done, one thread per CPU.
    """
    from .verify.verifier import Verifier

    cpus = os.cpu_count() or 1
    overlap = cpus >= OVERLAP_MIN_CPUS
    return Verifier(source, staging, out_dtype=settings.out_dtype, weights=settings.weights,
                    workers=settings.workers if overlap else min(settings.workers, cpus), index_name=INDEX_FILE,
                    full=settings.full_verify, during_copy=overlap)


OVERLAP_MIN_CPUS = 4  # compare tensors during the copy only on machines with at least this many CPUs


def _warm_imports(names: tuple[str, ...]) -> None:
    """Import modules the end of the run needs (``yaml`` for the model card, ``names``) while the kernel copies."""
    for name in (*names, "yaml"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the step that needs it reports it


class _Bar:
    """The tqdm progress bar's two calls the writer needs (tqdm is imported only when shown)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="consolidate",
                         file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def __call__(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class _LogProgress:
    """Progress as a log line at each quarter, where a bar would write carriage returns into a file (Slurm logs)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.next_quarter, self.t0 = max(total, 1), 0, 1, time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        while self.next_quarter <= 4 and self.done * 4 >= self.next_quarter * self.total:
            log.info("consolidate: %d%% (%.2f of %.2f GB, %.1f s)", 25 * self.next_quarter, self.done / 1e9,
                     self.total / 1e9, time.monotonic() - self.t0)
            self.next_quarter += 1

    def close(self) -> None:
        pass


def verify_output(source: Source, plan: OutputPlan, written: Written, *, verify: bool,
                  from_pretrained_max_bytes: int) -> VerificationReport:
    """Check what was written and say so in a report (verification.json's content).

    With ``verify``: the files parse with safetensors and hold the keys, dtypes and shapes
    the checkpoint declares, every tensor's values equal the source's (:mod:`.verify.verifier`, which
    derives the expected output from the checkpoint again instead of trusting ``plan``), the
    keys and shapes match the architecture in config.json, and (under
    ``from_pretrained_max_bytes``) transformers loads the result without complaint. Without
    it only the facts are recorded.

    Args:
        source: The opened checkpoints and reference.
        plan: From :func:`plan_output` (its names are used only for the architecture check).
        written: From :func:`write_output` (with verification, its ``outcome``).
        verify: Run the checks (else only record what was done).
        from_pretrained_max_bytes: Load the result with ``from_pretrained`` when smaller.

    Returns:
        The report; ``ok`` is False when any check failed, with the reasons in ``errors``.
    """
    report: VerificationReport = {"ok": True, "errors": [], "notes": list(source.notes) + plan.notes,
                                  "layout": source.layout, "dtype": plan.dtype}
    if source.layout == "deepspeed":
        report["deepspeed"] = [c.describe() for c in source.checkpoints if isinstance(c, DeepSpeedCheckpoint)]
    if source.meta_pt is not None:
        report["meta_pt"] = source.meta_pt
    if plan.tied is not None:
        same = bool(written.tied_identical)
        report["tied_lm_head"] = {"dropped": plan.tied.dropped, "kept": plan.tied.kept, "identical": same}
        if not same:
            report["notes"].append(f"'{plan.tied.dropped}' differed from '{plan.tied.kept}' in the checkpoint; "
                                   "dropped it because config.json ties them")
    if source.reference is not None:
        report["assets_copied"] = written.assets_copied
    report["nonfinite"] = {"scanned": "every byte written, in the copy (all verification modes)",
                           "allowed": bool(written.nonfinite), "tensors": written.nonfinite}
    if written.nonfinite:
        report["notes"].append(
            f"written with --allow-nonfinite: {len(written.nonfinite)} tensor(s) hold NaN or inf: "
            + ", ".join(describe(n, c) for n, c in written.nonfinite.items()))
    if verify:
        outcome = written.outcome
        if outcome is None:
            raise ConsolidationError("internal error: verification was asked for but the writer ran without it")
        report["tensors"], report["values"], report["files"] = outcome.tensors, outcome.values, outcome.files
        report["errors"] += outcome.errors
        shapes = {t.name: t.shape for t in plan.tensors}
        differ = names_note(source.reference.path, shapes) if source.reference is not None else None
        if differ:  # the reference's own weights name them otherwise (verify/reference_names.py)
            log.warning("note: %s", differ)
            report["notes"].append(differ)
        if record_architecture(report, written.architecture, shapes) and source.reference is not None:
            record_loading(report, written.directory, written.architectures[0], plan.total_bytes,
                           from_pretrained_max_bytes)
    if source.reference is None:
        report["notes"].append("no reference config.json found: wrote weights only, architecture checks skipped (pass --reference HF_DIR)")
    report["ok"] = not report["errors"]
    return report


def commit_output(staging: Path, out: Path, report: VerificationReport, source: Source, *,
                  replace: bool = False, in_place: bool = False) -> None:
    """Write verification.json, then move the staging directory to ``out`` once verification passed.

    verification.json also names the checkpoint directories the weights came from (``sources``):
    the report stage's model card (:mod:`fsdp_workflow.report.card`, run next by the consolidation
    job) reads the steps there.

    The move is a rename; the caller holds Ctrl-C off around it (:func:`deferred_interrupt`).
    With ``replace`` an existing ``out`` is first renamed aside, then removed once the new
    model is in place (and put back if the second rename fails), so ``out`` is at every
    moment either the old model or the new one. With ``in_place`` (an ``out`` that cannot
    be renamed, a mount point) the files are moved into ``out`` instead, ``verification.json``
    last (:func:`.in_place.commit_in_place`).

    Args:
        staging: The written model (:func:`write_output`).
        out: The final output directory.
        report: From :func:`verify_output`.
        source: For the error message.
        replace: ``--overwrite``: replace an existing ``out``.
        in_place: ``staging`` is inside ``out``, which cannot be renamed: replace its contents.

    Raises:
        ConsolidationError: Verification failed, or ``out`` appeared meanwhile (written by
            something other than this tool, whose runs hold a lock on it); ``out`` is not
            touched (the caller's :func:`staging_dir` removes the staging directory).
    """
    report["sources"] = [str(d) for d in source.dirs]  # type: ignore[typeddict-unknown-key]  # read by the card
    (staging / VERIFICATION_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    if not report["ok"]:
        raise ConsolidationError(f"verification failed for {source.dirs[-1]}: " + "; ".join(report["errors"])
                                 + f". Nothing was written to {out}.")
    if in_place:
        commit_in_place(staging, out)
        return
    old = None
    if replace and (out.exists() or out.is_symlink()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        try:
            os.rename(out, old)
        except OSError as exc:  # one the checks before the work did not foresee (in_place.cannot_rename)
            raise ConsolidationError(
                f"{out}: cannot move the earlier OUT aside to replace it ([Errno {exc.errno}] {exc.strerror}); "
                "nothing was changed there. Choose a new OUT, or empty it yourself and rerun") from None
    try:
        os.rename(staging, out)
    except OSError as exc:
        if old is not None:
            os.rename(old, out)
        raise ConsolidationError(
            f"{out}: cannot move the verified model there ([Errno {exc.errno}] {exc.strerror}): OUT appeared "
            "while this consolidation ran, written by another program (two consolidations are kept apart by a "
            "lock). Nothing was changed there; choose a new OUT, or pass --overwrite to replace it") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) off for the block, then raise it: a commit is never left half done.

    Only the main thread can install signal handlers; elsewhere (a library caller's thread)
    the block runs as is.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending and previous not in (signal.SIG_IGN, None):
        if callable(previous):
            previous(signal.SIGINT, None)  # the held Ctrl-C, taken as the handler in place takes it
        raise KeyboardInterrupt


def remove_sources(source: Source, report: VerificationReport) -> None:
    """Delete the source checkpoint directories (``--remove-sharded``), only after this invocation's verification passed.

    Raises:
        ConsolidationError: ``report`` is not a passed verification of every tensor (an
            internal guard: the options refuse ``--remove-sharded`` with ``--no-verify``).
    """
    if not (report.get("ok") and report.get("tensors")):
        raise ConsolidationError("internal error: --remove-sharded without a passed verification; the shards are kept")
    for d in source.dirs:
        shutil.rmtree(d)
