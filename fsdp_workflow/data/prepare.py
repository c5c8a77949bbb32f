"""The prepare step: records -> masked token documents -> a packed token cache, once.

    python -m fsdp_workflow.data.prepare RUN_DIR [--workers N]

Reads ``RUN_DIR/config.yaml``, tokenises with several processes, writes the
cache under ``data.cache_dir`` (default: the run directory's cache root) in a
directory named by the cache key, and records which cache the run trains on in
the run directory's data pointer. A cache whose key matches is reused: a
resubmit, or a second experiment sharing ``data.cache_dir``, skips the work.

Exit codes: 0 done (or reused); 2 bad data or config (the message names the
file and line, or the key); 1 unexpected (a traceback).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from fsdp_workflow.config.schema import DataFormat, DataSource, ModelInit, OnBadRecord, WorkflowConfig, run_layout
from fsdp_workflow.core.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from fsdp_workflow.core.logs import recorded_log_level, report_user_error, setup_logging
from fsdp_workflow.core.rundir import TMP_SUFFIX, atomic_write_json
from fsdp_workflow.data.cache import (FORMAT_VERSION, META_FILE, SPLITS, CacheError, commit_cache, verify_cache,
                                      write_split)
from fsdp_workflow.data.encode import ChunkResult, EncodeSpec, encode_chunk, init_worker
from fsdp_workflow.data.formats import FormatSpec
from fsdp_workflow.data.sources import DataError, describe_files, expand, iter_chunks
from fsdp_workflow.data.templates import TemplateError, resolve_template
from fsdp_workflow.data.tokenizer import load_tokenizer, tokenizer_source

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


def needs_template(cfg: WorkflowConfig) -> bool:
    """Conversations always use a chat template; prompt/completion and Alpaca when one is set."""
    d = cfg.data
    return d.format == DataFormat.conversation or (
        d.format in (DataFormat.prompt_completion, DataFormat.alpaca) and bool(d.chat_template))


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
              template: Optional[str]) -> str:
    """sha256 over everything that changes the cache's content."""
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
    import multiprocessing

    # fork: the workers inherit the tokenizer and the compiled template set up above
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers, initializer=_child_init) as pool:
        pending: Deque[Any] = collections.deque()
        for c in chunks:
            pending.append(pool.apply_async(encode_chunk, (c,)))
            if len(pending) >= 2 * workers:
                res = pending.popleft().get()
                on_result(res)
                out.append(res)
        while pending:
            res = pending.popleft().get()
            on_result(res)
            out.append(res)
    return out


def _child_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism


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


def _bad_report(bad: List[Tuple[str, int, str]], fmt: DataFormat) -> str:
    lines = [f"  {f}:{line}: {why}" for f, line, why in bad[:MAX_BAD_SHOWN]]
    more = f"\n  ... and {len(bad) - MAX_BAD_SHOWN} more" if len(bad) > MAX_BAD_SHOWN else ""
    names = "name the text field with data.text_field" if fmt == DataFormat.text else \
        "map the field names with data.fields.*"
    return (f"{len(bad)} bad record(s):\n" + "\n".join(lines) + more +
            f"\nFix the data, {names}, or set data.on_bad_record=skip to leave "
            "them out (they are counted in the cache's meta.json).")


def _read_split(cfg: WorkflowConfig, files: Sequence[str], key_name: str, spec: EncodeSpec, tokenizer: Any,
                workers: int, progress: bool, file_index: Dict[str, int]) -> _Docs:
    prog = _Progress(key_name, progress)
    chunks = iter_chunks(cfg.data.source, files, key_name, CHUNK_RECORDS)
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
    if d.source == DataSource.synthetic:
        prepared = Prepared(None, "", False, {"synthetic": True})
        write_pointer(cfg, prepared)
        return prepared
    files = expand(d.source, d.path, "data.path")
    eval_files = expand(d.source, d.eval_path, "data.eval_path") if d.eval_path else []
    tokenizer = load_tokenizer(cfg.model)
    check_vocab(cfg, len(tokenizer))
    src = tokenizer_source(cfg.model) or "byte-level"
    template = (resolve_template(d.chat_template, getattr(tokenizer, "chat_template", None), src)
                if needs_template(cfg) else None)
    tok_id = tokenizer_identity(cfg)
    key = cache_key(cfg, files, eval_files, tok_id, template)
    root = cache_root(cfg)
    final = root / key[:16]
    existing = _existing(final, key)
    if existing is not None:
        if progress:
            log.info("prepare: reusing the token cache %s (same data, tokenizer, template and settings)", final)
        prepared = Prepared(final, key, True, existing)
        write_pointer(cfg, prepared)
        return prepared

    workers = num_workers or d.num_workers or available_cpus()
    fmt = FormatSpec(d.format, d.text_field, dict(d.fields), d.train_on, d.add_eos, template)
    spec = EncodeSpec(cfg.model, fmt, d.source == DataSource.jsonl, cfg.train.seq_len, d.overlong)
    t0 = time.monotonic()
    source_files = [str(f) for f in files] + [str(f) for f in eval_files]
    file_index = {f: i for i, f in enumerate(source_files)}
    train = _read_split(cfg, files, "data.path", spec, tokenizer, workers, progress, file_index)
    held = (_read_split(cfg, eval_files, "data.eval_path", spec, tokenizer, workers, progress, file_index)
            if eval_files else None)
    bad = train.bad + (held.bad if held else [])
    if bad and d.on_bad_record == OnBadRecord.fail:
        raise DataError(_bad_report(bad, d.format))
    n_docs = len(train.offsets) - 1
    if n_docs == 0:
        raise DataError(f"data.path={d.path!r}: no usable documents"
                        + (f" ({len(bad)} bad records skipped)" if bad else "") + ".")

    rng = np.random.default_rng(d.seed)
    if held is None and d.eval_fraction > 0:
        is_held = rng.random(n_docs) < d.eval_fraction  # document-level, seeded: the same on every run
        if is_held.all():
            raise DataError(f"data.eval_fraction={d.eval_fraction} left no training documents; lower it.")
        train_idx, held_src, held_idx = np.flatnonzero(~is_held), train, np.flatnonzero(is_held)
    else:
        train_idx = np.arange(n_docs)
        held_src, held_idx = held, (np.arange(len(held.offsets) - 1) if held else np.zeros(0, np.int64))
    train_idx = train_idx[rng.permutation(len(train_idx))]

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key[:16]}.{os.getpid()}{TMP_SUFFIX}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        splits: Dict[str, Dict[str, int]] = {}
        toks, labs, srcs = train.take(train_idx)
        splits[SPLITS[0]] = write_split(tmp / SPLITS[0], toks, labs, cfg.train.seq_len, srcs)
        if held_src is not None and len(held_idx):
            toks, labs, srcs = held_src.take(held_idx)
            splits[SPLITS[1]] = write_split(tmp / SPLITS[1], toks, labs, cfg.train.seq_len, srcs)
        del toks, labs, srcs
        counts = {k: train.counts[k] + (held.counts[k] if held else 0) for k in train.counts}
        meta: Dict[str, Any] = {
            "key": key, "seq_len": cfg.train.seq_len, "splits": splits, **counts,
            "source": d.source.value, "format": d.format.value, "train_on": d.train_on.value,
            "overlong": d.overlong.value, "tokenizer": src, "tokenizer_sha256": tok_id,
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "chat_template": template, "files": [str(f) for f in files], "eval_files": [str(f) for f in eval_files],
            "source_files": source_files,
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
                 f"{meta['dropped_overlong']} dropped as overlong")
    prepared = Prepared(final, key, False, meta)
    write_pointer(cfg, prepared)
    return prepared


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
    try:
        cfg = load_run_config(args.run_dir)
        prepare(cfg, num_workers=args.workers)
    except (DataError, TemplateError, CacheError, ConfigError, FileNotFoundError, OmegaConfBaseException) as err:
        report_user_error(log, f"prepare: {err}", err)
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 - the traceback is the report
        log.exception("prepare failed")
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
