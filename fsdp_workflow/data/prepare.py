"""The prepare step: records -> masked token documents -> a packed token cache, once.

    python -m fsdp_workflow.data.prepare RUN_DIR [--workers N]

Reads ``RUN_DIR/config.yaml``, tokenises with several processes, writes the
cache under ``data.cache_dir`` (default: the run directory's cache root) in a
directory named by the cache key, and records which cache the run trains on in
the run directory's data pointer. A cache whose key matches is reused: a
resubmit, or a second experiment sharing ``data.cache_dir``, skips the work.

Exit codes: 0 done (or reused); 2 bad data or config (the message names the
file and line, or the key); 130 Ctrl-C and 143 SIGTERM (nothing of this
prepare kept); 1 unexpected (a traceback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from fsdp_workflow.config.schema import DataFormat, DataSource, ModelInit, OnBadRecord, WorkflowConfig, run_layout
from fsdp_workflow.core.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from fsdp_workflow.core.interrupts import sigterm_as_ctrl_c, stopped_by
from fsdp_workflow.core.logs import recorded_log_level, report_user_error, setup_logging
from fsdp_workflow.core.rundir import TMP_SUFFIX, atomic_write_json
from fsdp_workflow.data.cache import (FORMAT_VERSION, META_FILE, SPLITS, CacheError, commit_cache, verify_cache,
                                      write_split)
from fsdp_workflow.data.encode import ChunkResult, EncodeSpec, encode_chunk, init_worker
from fsdp_workflow.data.formats import FIELD_PROBLEMS, FormatSpec
from fsdp_workflow.data.mixture import Source, document_counts, is_mixture, resolve_sources, select
from fsdp_workflow.data.mixture import describe as describe_sources
from fsdp_workflow.data.sources import DataError, describe_files, expand, iter_chunks
from fsdp_workflow.data.summary import epochs_note
from fsdp_workflow.data.templates import TemplateError, choose_template
from fsdp_workflow.data.tokenizer import load_tokenizer, tokenizer_source
from fsdp_workflow.data.workers import WorkerDied, ordered_map

log = logging.getLogger(__name__)

CHUNK_RECORDS = 512  # records per worker task: big enough to amortise, small enough to balance
MAX_BAD_SHOWN = 5
PROGRESS_EVERY_S = 5.0  # a progress line at most this often (a log file gets lines, not a bar)
# Files of a model directory that never change tokenisation (not hashed into the key).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


@dataclass
class Prepared:
    """What :func:`prepare` did."""

    path: Optional[Path]  # the cache directory; None for data.source=synthetic
    key: str  # the cache key (sha256 hex); "" for synthetic
    reused: bool  # an existing cache with this key was used as is
    meta: Dict[str, Any] = field(default_factory=dict)  # the cache's meta.json


def format_needs_template(fmt: DataFormat, chat_template: Optional[str]) -> bool:
    """Conversations always use a chat template; prompt/completion and Alpaca when one is set."""
    return fmt == DataFormat.conversation or (
        fmt in (DataFormat.prompt_completion, DataFormat.alpaca) and bool(chat_template))


def needs_template(cfg: WorkflowConfig) -> bool:
    """Whether any source of ``cfg.data`` is rendered with the chat template."""
    d = cfg.data
    formats = [s.format for s in resolve_sources(d)] or [d.format]
    return any(format_needs_template(f, d.chat_template) for f in formats)


def tokenizer_identity(cfg: WorkflowConfig) -> str:
    """``byte-level``, or a sha256 over the tokenizer directory's files (weights left out)."""
    src = tokenizer_source(cfg.model)
    if src is None:
        return "byte-level"
    h = hashlib.sha256()
    root = Path(src)
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.startswith("."):
            h.update(str(p.relative_to(root)).encode() + b"\0")
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def cache_key(cfg: WorkflowConfig, files: Sequence[str], eval_files: Sequence[str], tokenizer_id: str,
              template: Optional[str], mixture: Optional[List[Tuple[Source, Sequence[str]]]] = None) -> str:
    """sha256 over everything that changes the cache's content.

    A mixture adds every source: its files (path, size, mtime), reader,
    format, fields, text field, weight and sample count. One ``data.path`` keeps
    the key it always had.
    """
    d = cfg.data
    parts = {
        "format_version": FORMAT_VERSION,
        "source": d.source.value,
        "files": [vars(f) for f in describe_files(d.source, files)],
        "eval_files": [vars(f) for f in describe_files(d.source, eval_files)],
        "tokenizer": tokenizer_id,
        "template": template,
        "seq_len": cfg.train.seq_len,
        "format": d.format.value,
        "fields": dict(sorted(d.fields.items())),
        "text_field": d.text_field,
        "train_on": d.train_on.value,
        "overlong": d.overlong.value,
        "add_eos": d.add_eos,
        "eval_fraction": d.eval_fraction if not d.eval_path else None,
        "seed": d.seed,
    }
    if d.allow_no_user:  # only when set: the keys of caches prepared before it existed stay valid
        parts["allow_no_user"] = True
    if mixture is not None:
        parts["sources"] = [{"name": s.name, "source": s.source.value, "format": s.format.value,
                             "text_field": s.text_field, "fields": dict(sorted(s.fields.items())),
                             "weight": s.weight, "num_samples": s.num_samples,
                             "files": [vars(f) for f in describe_files(s.source, fs)]} for s, fs in mixture]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_root(cfg: WorkflowConfig) -> Path:
    """``data.cache_dir``, or the run directory's default cache root."""
    if cfg.data.cache_dir:
        return Path(os.path.abspath(os.path.expanduser(cfg.data.cache_dir)))
    return run_layout(cfg).data_cache


def available_cpus() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


class _Progress:
    """Records/s and tokens, one log line every few seconds (a log file gets lines, not a bar)."""

    def __init__(self, label: str, enabled: bool, every_s: Optional[float] = None) -> None:
        self.label, self.enabled = label, enabled
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.start = self.last = time.monotonic()
        self.records = self.tokens = 0

    def add(self, res: ChunkResult) -> None:
        self.records += res.records
        self.tokens += int(res.tokens.size)
        now = time.monotonic()
        if self.enabled and now - self.last >= self.every_s:
            self.last = now
            self.report()

    def report(self) -> None:
        dt = max(time.monotonic() - self.start, 1e-9)
        log.info("prepare [%s]: %s records (%s/s), %s tokens (%s/s)", self.label, f"{self.records:,}",
                 f"{self.records / dt:,.0f}", f"{self.tokens:,}", f"{self.tokens / dt:,.0f}")


def _encode_all(chunks: Iterable[Any], spec: EncodeSpec, tokenizer: Any, workers: int,
                on_result: Callable[[ChunkResult], None]) -> List[ChunkResult]:
    """Encode chunks in order, with ``workers`` processes (at most 2 chunks in flight per worker)."""
    init_worker(spec, tokenizer)
    out: List[ChunkResult] = []
    if workers <= 1:
        for c in chunks:
            res = encode_chunk(c)
            on_result(res)
            out.append(res)
        return out
    # forked: the workers inherit the tokenizer and the compiled template set up above
    for res in ordered_map(encode_chunk, chunks, workers):
        on_result(res)
        out.append(res)
    return out


@dataclass
class _Docs:
    """Encoded documents of one source, back to back."""

    tokens: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray  # int64 [D+1]
    counts: Dict[str, int]
    bad: List[Tuple[str, int, str]]
    sources: np.ndarray  # int64 [D, 2]: (index into the cache's source_files, line)

    def take(self, index: np.ndarray) -> Tuple[List[np.ndarray], List[np.ndarray], np.ndarray]:
        o = self.offsets
        return ([self.tokens[o[i]:o[i + 1]] for i in index], [self.labels[o[i]:o[i + 1]] for i in index],
                self.sources[index])


def _gather(results: List[ChunkResult], file_index: Dict[str, int]) -> _Docs:
    lengths = np.concatenate([r.lengths for r in results]) if results else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([r.tokens for r in results]) if results else np.zeros(0, np.int32)
    labels = np.concatenate([r.labels for r in results]) if results else np.zeros(0, np.int32)
    counts = {k: sum(getattr(r, k) for r in results)
              for k in ("records", "truncated", "dropped_overlong", "dropped_untrained")}
    bad = [b for r in results for b in r.bad]
    counts["bad_records"] = len(bad)
    sources = np.zeros((len(lengths), 2), dtype=np.int64)
    if results:
        sources[:, 0] = np.concatenate([np.full(len(r.lines), file_index.get(r.path, -1), np.int64)
                                        for r in results])
        sources[:, 1] = np.concatenate([r.lines for r in results])
    results.clear()  # the per-chunk arrays are copied above: free them before the split is written
    return _Docs(tokens, labels, offsets, counts, bad, sources)


def _fix_hint(src: Source) -> str:
    return (f"name the text field with {src.sub('text_field')}" if src.format == DataFormat.text else
            f"map the field names with {src.sub('fields')}.*")


def _bad_report(bad: List[Tuple[str, int, str]], hints: Sequence[str]) -> str:
    lines = [f"  {f}:{line}: {why}" for f, line, why in bad[:MAX_BAD_SHOWN]]
    more = f"\n  ... and {len(bad) - MAX_BAD_SHOWN} more" if len(bad) > MAX_BAD_SHOWN else ""
    return (f"{len(bad)} bad record(s):\n" + "\n".join(lines) + more +
            f"\nFix the data{''.join(', ' + h for h in dict.fromkeys(hints))}, or set data.on_bad_record=skip to leave "
            "them out (they are counted in the cache's meta.json).")


def _read_split(source: DataSource, files: Sequence[str], key_name: str, spec: EncodeSpec, tokenizer: Any,
                workers: int, progress: bool, file_index: Dict[str, int]) -> _Docs:
    prog = _Progress(key_name, progress)
    chunks = iter_chunks(source, files, key_name, CHUNK_RECORDS)
    docs = _gather(_encode_all(chunks, spec, tokenizer, workers, prog.add), file_index)
    if progress:
        prog.report()
    return docs


def write_pointer(cfg: WorkflowConfig, prepared: Prepared) -> None:
    """Record in the run directory which cache it trains on (atomically)."""
    layout = run_layout(cfg)
    layout.root.mkdir(parents=True, exist_ok=True)
    if prepared.path is None:
        atomic_write_json(layout.data_pointer, {"cache": None, "synthetic": True})
    else:
        atomic_write_json(layout.data_pointer, {"cache": str(prepared.path), "key": prepared.key})


def model_vocab_size(cfg: WorkflowConfig) -> Optional[int]:
    """The embedding rows the model will have: ``model.vocab_size`` for random init, else its config.json's."""
    if cfg.model.init == ModelInit.random or not cfg.model.name_or_path:
        return cfg.model.vocab_size
    try:
        with open(os.path.join(cfg.model.name_or_path, "config.json"), encoding="utf-8") as f:
            value = json.load(f).get("vocab_size")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def check_vocab(cfg: WorkflowConfig, tokenizer_size: int) -> None:
    """Refuse a tokenizer with more ids than the model has embeddings: found here, not as an index error on a GPU.

    Raises:
        DataError: naming both sizes and the keys to fix.
    """
    rows = model_vocab_size(cfg)
    if rows is not None and tokenizer_size > rows:
        raise DataError(
            f"the tokenizer has {tokenizer_size} tokens but the model has {rows} embedding rows "
            f"(model.vocab_size / the model's config.json): token ids past {rows - 1} would crash training. "
            "Point model.tokenizer at the model's own tokenizer, or raise model.vocab_size for a random init.")


def prepare(cfg: WorkflowConfig, *, num_workers: Optional[int] = None, progress: bool = True) -> Prepared:
    """Tokenise, mask and pack ``cfg.data`` into a token cache (or reuse the one with the same key).

    Args:
        cfg: the run's config.
        num_workers: tokenising processes; None: ``data.num_workers``, else the CPUs available.
        progress: report progress on stderr.

    Returns:
        The cache's path, key, whether it was reused, and its meta.

    Raises:
        DataError: unreadable or bad data (file and line named), or nothing left to train.
        TemplateError: no usable chat template.
    """
    d = cfg.data
    if d.source == DataSource.synthetic and not d.sources:
        prepared = Prepared(None, "", False, {"synthetic": True})
        write_pointer(cfg, prepared)
        return prepared
    sources = resolve_sources(d)
    if not sources:
        expand(d.source, d.path, "data.path")  # raises: data.path is not set
    per_files = [(src, expand(src.source, src.path, src.sub("path"))) for src in sources]
    _refuse_shared_files(per_files)
    files = [f for _, fs in per_files for f in fs]
    eval_files = expand(d.source, d.eval_path, "data.eval_path") if d.eval_path else []
    tokenizer = load_tokenizer(cfg.model)
    check_vocab(cfg, len(tokenizer))
    tok_src = tokenizer_source(cfg.model) or "byte-level"
    choice = (choose_template(d.chat_template, d.fallback_chat_template, getattr(tokenizer, "chat_template", None),
                              tok_src) if needs_template(cfg) else None)
    template = choice.text if choice is not None else None
    tok_id = tokenizer_identity(cfg)
    key = cache_key(cfg, files, eval_files, tok_id, template, per_files if is_mixture(d) else None)
    root = cache_root(cfg)
    final = root / key[:16]
    existing = _existing(final, key)
    if existing is not None:
        if progress:
            log.info("prepare: reusing the token cache %s (same data, tokenizer, template and settings)", final)
        prepared = Prepared(final, key, True, existing)
        _note_epochs(cfg, existing)
        write_pointer(cfg, prepared)
        return prepared

    workers = num_workers or d.num_workers or available_cpus()
    t0 = time.monotonic()
    source_files = files + [str(f) for f in eval_files]
    file_index = {f: i for i, f in enumerate(source_files)}

    def spec_for(fmt: DataFormat, text_field: str, fields: Dict[str, str], reader: DataSource) -> EncodeSpec:
        fs = FormatSpec(fmt, text_field, dict(fields), d.train_on, d.add_eos,
                        template if format_needs_template(fmt, d.chat_template) else None, d.allow_no_user)
        return EncodeSpec(cfg.model, fs, reader == DataSource.jsonl, cfg.train.seq_len, d.overlong)

    read = [_read_split(src.source, fs, src.key, spec_for(src.format, src.text_field, src.fields, src.source),
                        tokenizer, workers, progress, file_index) for src, fs in per_files]
    held = (_read_split(d.source, eval_files, "data.eval_path", spec_for(d.format, d.text_field, d.fields, d.source),
                        tokenizer, workers, progress, file_index) if eval_files else None)
    bad = [b for docs in read for b in docs.bad] + (held.bad if held else [])
    if bad and d.on_bad_record == OnBadRecord.fail:
        # The field-mapping hint only where a record lacks its fields: a bad byte or a cut-off line
        # is fixed in the data, and plain text files have no fields to name.
        field_files = {f for f, _, why in bad if why.startswith(FIELD_PROBLEMS)}
        hints = [_fix_hint(src) for src, fs in per_files if field_files & set(fs)]
        raise DataError(_bad_report(bad, hints or ([_fix_hint(sources[0])] if field_files else [])))
    plan = _mix(cfg, sources, read, held)

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key[:16]}.{os.getpid()}{TMP_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        splits: Dict[str, Dict[str, int]] = {}
        toks, labs, srcs = _take_all(plan.train)
        splits[SPLITS[0]] = write_split(tmp / SPLITS[0], toks, labs, cfg.train.seq_len, srcs)
        if plan.held:
            toks, labs, srcs = _take_all(plan.held)
            splits[SPLITS[1]] = write_split(tmp / SPLITS[1], toks, labs, cfg.train.seq_len, srcs)
        del toks, labs, srcs
        parts = read + ([held] if held else [])
        counts = {k: sum(docs.counts[k] for docs in parts) for k in read[0].counts}
        meta: Dict[str, Any] = {
            "key": key, "seq_len": cfg.train.seq_len, "splits": splits, **counts,
            "source": d.source.value, "format": d.format.value, "train_on": d.train_on.value,
            "overlong": d.overlong.value, "tokenizer": tok_src, "tokenizer_sha256": tok_id,
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "chat_template": template, "chat_template_name": choice.label if choice else None,
            "chat_template_key": choice.key if choice else None, "files": files, "eval_files": [str(f) for f in eval_files],
            "source_files": source_files, "mixture": is_mixture(d), "sources": plan.rows,
            "workers": workers, "seconds": round(time.monotonic() - t0, 3),
        }
        commit_cache(tmp, final, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = json.loads((final / META_FILE).read_text())
    if progress:
        tr = meta["splits"][SPLITS[0]]
        log.info(f"prepare: wrote {final}: {tr['documents']:,} documents, {tr['samples']:,} samples, "
                 f"{tr['tokens']:,} tokens ({tr['trained_tokens']:,} trained) in {meta['seconds']:.1f}s; "
                 f"{meta['bad_records']} bad records skipped, {meta['truncated']} truncated, "
                 f"{meta['dropped_overlong']} dropped as overlong, "
                 f"{meta.get('dropped_untrained', 0)} dropped as truncated to nothing trained")
        for line in describe_sources(meta):
            log.info("prepare:   %s", line)
    warning = eval_split_warning(cfg, meta)
    if warning:
        log.warning("prepare: warning: %s", warning)
    _note_epochs(cfg, meta)
    prepared = Prepared(final, key, False, meta)
    write_pointer(cfg, prepared)
    return prepared


def _note_epochs(cfg: WorkflowConfig, meta: Dict[str, Any]) -> None:
    """Say how many epochs train.max_steps makes over the packed training samples, when many (issue 49)."""
    samples = int((meta.get("splits", {}).get(SPLITS[0]) or {}).get("samples", 0))
    note = epochs_note(cfg, samples, exact=True)
    if note:
        log.info("prepare: note: %s", note)


def eval_split_warning(cfg: WorkflowConfig, meta: Dict[str, Any]) -> Optional[str]:
    """Why the held-out split just written cannot make a real evaluation; None when it can (or none was asked).

    ``data.eval_fraction`` draws documents at random, so a small corpus or fraction may hold
    out none (every evaluation then measures nothing), or fewer packed samples than one
    evaluation reads (``train.eval_batches`` micro-batches: the same samples are measured
    again and again, and the eval loss rests on less text than it seems).
    """
    d, t = cfg.data, cfg.train
    if not d.eval_path and d.eval_fraction <= 0:
        return None
    held = meta["splits"].get(SPLITS[1]) or {}
    samples = int(held.get("samples", 0))
    where = f"data.eval_path={d.eval_path}" if d.eval_path else f"data.eval_fraction={d.eval_fraction:g}"
    if samples == 0:
        trained = meta["splits"][SPLITS[0]]["documents"]
        return (f"{where} held out no document ({trained:,} training documents), so there is nothing to evaluate "
                "on: train.eval_every_steps and per-checkpoint evaluations measure nothing. Fix: raise "
                "data.eval_fraction, or set data.eval_path to a file of held-out documents")
    need = t.eval_batches * t.micro_batch_size
    if samples < need:
        return (f"{where} held out {samples:,} packed samples ({held.get('tokens', 0):,} tokens), fewer than one "
                f"evaluation reads per rank (train.eval_batches={t.eval_batches} x train.micro_batch_size="
                f"{t.micro_batch_size} = {need} samples): the same samples are measured more than once and the "
                "eval loss rests on less text than it seems. Fix: raise data.eval_fraction (or a larger "
                f"data.eval_path), or train.eval_batches={max(samples // t.micro_batch_size, 1)}")
    return None


def _refuse_shared_files(per_files: Sequence[Tuple[Source, Sequence[str]]]) -> None:
    """A file read by two sources would make file:line ambiguous and double its share: refused."""
    owner: Dict[str, str] = {}
    for src, fs in per_files:
        for f in fs:
            if f in owner and owner[f] != src.key:
                raise DataError(f"{owner[f]} and {src.key} both read {f}: give each file to one source "
                                "(to weigh a file more, raise its source's weight or num_samples).")
            owner[f] = src.key


@dataclass
class _MixPlan:
    """Which documents of which source go where, in the order they are written, plus meta.json's per-source rows."""

    train: List[Tuple[_Docs, np.ndarray]]  # runs of (source docs, indices), in the order written
    held: List[Tuple[_Docs, np.ndarray]]
    rows: List[Dict[str, Any]]


def _why_none(counts: Dict[str, int], seq_len: int) -> str:
    """Why a source gave no document: each way its records were lost, counted, with the fix."""
    reasons = []
    if counts["bad_records"]:
        reasons.append(f"{counts['bad_records']} bad records skipped")
    if counts["dropped_untrained"]:
        reasons.append(f"{counts['dropped_untrained']} truncated to train.seq_len={seq_len} with no trained token "
                       "left (the answer came after the cut: raise train.seq_len, or shorten the prompts)")
    if counts["dropped_overlong"]:
        reasons.append(f"{counts['dropped_overlong']} longer than train.seq_len={seq_len}, dropped "
                       "(data.overlong=drop: raise train.seq_len, or data.overlong=truncate)")
    return f" of {counts['records']} records: " + "; ".join(reasons) + "." if reasons else f" ({counts['records']} records)."


def _mix(cfg: WorkflowConfig, sources: Sequence[Source], read: Sequence[_Docs], held: Optional[_Docs]) -> _MixPlan:
    """Hold out, take each source's share and shuffle, all from one generator seeded by ``data.seed``.

    The draws happen in a fixed order (hold-out per source, then each source's
    sample, then the shuffle), so the same config gives the same cache byte for
    byte. One ``data.path`` draws exactly what it always did.

    Raises:
        DataError: a source (or the whole data) has no usable documents left.
    """
    d = cfg.data
    rng = np.random.default_rng(d.seed)
    train_idx: List[np.ndarray] = []
    held_parts: List[Tuple[_Docs, np.ndarray]] = []
    for src, docs in zip(sources, read):
        n = len(docs.offsets) - 1
        if n == 0:
            what = f"{d.path!r}" if src.key == "data.path" else f"{src.name!r} ({src.path})"
            raise DataError(f"{src.key}={what}: no usable documents" + _why_none(docs.counts, cfg.train.seq_len))
        if held is None and d.eval_fraction > 0:
            is_held = rng.random(n) < d.eval_fraction  # document-level, seeded: the same on every run
            if is_held.all():
                raise DataError(f"data.eval_fraction={d.eval_fraction} left no training documents"
                                + ("" if src.key == "data.path" else f" of {src.key}") + "; lower it.")
            train_idx.append(np.flatnonzero(~is_held))
            held_parts.append((docs, np.flatnonzero(is_held)))
        else:
            train_idx.append(np.arange(n))
    if held is not None:
        held_parts = [(held, np.arange(len(held.offsets) - 1))]
    counts = document_counts(sources, [len(t) for t in train_idx])
    if len(sources) > 1 or is_mixture(d):
        train_idx = [t[select(rng, len(t), c)] for t, c in zip(train_idx, counts)]
    parts = [(docs, t) for docs, t in zip(read, train_idx)]
    total = sum(len(t) for t in train_idx)
    order = rng.permutation(total)
    rows = _rows(sources, read, parts, held_parts if held is None else [])
    for src, row in zip(sources, rows):
        if row["train_documents"] == 0:
            log.warning("prepare: %s (%s) gives no training document: its share of a mixture of %s documents "
                        "rounds to 0; raise its weight, or give num_samples", src.key, src.name, f"{total:,}")
    # one list of (docs, index) pairs in the final order: runs of the same source are merged by _take_all
    owner = np.concatenate([np.full(len(t), i, np.int64) for i, t in enumerate(train_idx)])[order]
    local = np.concatenate(train_idx)[order]
    train = [(read[int(i)], local[owner == i]) for i in range(len(read))]
    return _MixPlan(_interleave(train, owner), [(h, i) for h, i in held_parts if len(i)], rows)


def _interleave(train: List[Tuple[_Docs, np.ndarray]], owner: np.ndarray) -> List[Tuple[_Docs, np.ndarray]]:
    """The shuffled documents as consecutive runs of one source each, in the shuffled order."""
    if len(train) == 1:
        return train
    cursor = [0] * len(train)
    out: List[Tuple[_Docs, np.ndarray]] = []
    if len(owner) == 0:
        return out
    cuts = np.flatnonzero(np.diff(owner)) + 1
    for run in np.split(owner, cuts):
        i = int(run[0])
        docs, idx = train[i]
        out.append((docs, idx[cursor[i]:cursor[i] + len(run)]))
        cursor[i] += len(run)
    return out


def _rows(sources: Sequence[Source], read: Sequence[_Docs], parts: Sequence[Tuple[_Docs, np.ndarray]],
          held_parts: Sequence[Tuple[_Docs, np.ndarray]]) -> List[Dict[str, Any]]:
    """meta.json's ``sources``: per source what was read, skipped, held out and taken."""
    taken = [int(len(t)) for _, t in parts]
    tokens = [int(np.diff(docs.offsets)[t].sum()) for docs, t in parts]
    held_n = {id(docs): int(len(i)) for docs, i in held_parts}
    n_docs, n_tok = max(sum(taken), 1), max(sum(tokens), 1)
    rows = []
    for src, docs, k, tk in zip(sources, read, taken, tokens):
        rows.append({"name": src.name, "key": src.key, "path": src.path, "source": src.source.value,
                     "format": src.format.value, "weight": src.weight, "num_samples": src.num_samples,
                     "records": docs.counts["records"], "bad_records": docs.counts["bad_records"],
                     "truncated": docs.counts["truncated"], "dropped_overlong": docs.counts["dropped_overlong"],
                     "documents": int(len(docs.offsets) - 1), "held_out": held_n.get(id(docs), 0),
                     "train_documents": k, "train_tokens": tk,
                     "document_share": round(k / n_docs, 6), "token_share": round(tk / n_tok, 6)})
    return rows


def _take_all(parts: Sequence[Tuple[_Docs, np.ndarray]]) -> Tuple[List[np.ndarray], List[np.ndarray], np.ndarray]:
    toks: List[np.ndarray] = []
    labs: List[np.ndarray] = []
    srcs: List[np.ndarray] = []
    for docs, idx in parts:
        t, lab, s = docs.take(idx)
        toks += t
        labs += lab
        srcs.append(s)
    return toks, labs, (np.concatenate(srcs) if srcs else np.zeros((0, 2), np.int64))


def _existing(final: Path, key: str) -> Optional[Dict[str, Any]]:
    """The meta of a sound cache with this key at ``final``; None after moving away anything else found there.

    A damaged cache (a file truncated or changed, :func:`verify_cache`), one of
    another format version or key, or a directory without a readable meta is
    never reused: it is removed so that the rebuilt one can take its place.
    """
    if not final.exists():
        return None
    why = ""
    try:
        meta = json.loads((final / META_FILE).read_text())
        if meta.get("key") != key or meta.get("format_version") != FORMAT_VERSION:
            why = f"format {meta.get('format_version')} / key {str(meta.get('key'))[:16]}"
        else:
            verify_cache(final, meta)
            return meta
    except (OSError, ValueError) as err:  # CacheError is a ValueError
        why = str(err)
    log.warning("prepare: not reusing %s (%s); rebuilding it", final, why)
    aside = final.with_name(f".{final.name}.stale.{os.getpid()}{TMP_SUFFIX}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        return None  # another prepare moved it first
    shutil.rmtree(aside, ignore_errors=True)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_workflow.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run directory (holding config.yaml)")
    parser.add_argument("--workers", type=int, default=None, help="tokenising processes (default: data.num_workers "
                        "or the CPUs available)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers={args.workers}: give 1 or more")
    from omegaconf.errors import OmegaConfBaseException

    from fsdp_workflow.config.errors import ConfigError
    from fsdp_workflow.config.load import load_run_config

    setup_logging(recorded_log_level(args.run_dir))
    restore = sigterm_as_ctrl_c()  # kill, timeout, the local launcher: the same cleanup as Ctrl-C, exit 143
    try:
        cfg = load_run_config(args.run_dir)
        prepare(cfg, num_workers=args.workers)
    except (DataError, TemplateError, CacheError, ConfigError, FileNotFoundError, OmegaConfBaseException) as err:
        report_user_error(log, f"prepare: {err}", err)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; the workers ignore both (data/workers.py): one message, from here
        code, how = stopped_by()
        log.error("prepare: %s; nothing of this prepare is kept or used (a cache is published only when "
                  "complete). Run the same command again to prepare from the start.", how)
        return code
    except WorkerDied as err:  # the kernel's OOM killer, most often: its message says what to lower
        log.error("prepare: %s", err)
        return EXIT_FAILURE
    except Exception:  # noqa: BLE001 - the traceback is the report
        log.exception("prepare failed")
        return EXIT_FAILURE
    finally:
        restore()
    return EXIT_OK


if __name__ == "__main__":
    from fsdp_workflow.core.fastexit import run_main

    run_main(main)  # sys.exit(main()), without tearing down torch's modules (fastexit)
