"""The token cache: tokenised, masked, packed data as memory-mapped numpy arrays.

Written once by the prepare step (:mod:`fsdp_workflow.data.prepare`), read by
every rank with ``np.load(..., mmap_mode="r")``, so RAM per rank does not grow
with the corpus. Readable with numpy alone (docs/data.md)::

    CACHE/                          one directory per cache key
      meta.json                     format_version, key, seq_len, counts, what built it,
                                    source_files, and "check": each array file's size and sampled sha256
      train/ eval/                  one directory per split (eval/ may be absent)
        tokens.npy     int32 [T]    every document's token ids, documents back to back
        labels.npy     int32 [T]    the token id where it carries loss, else -100
                                    (aligned with tokens; the model shifts by one itself)
        doc_offsets.npy int64 [D+1] document d is tokens[doc_offsets[d]:doc_offsets[d+1]]
        sample_docs.npy int64 [S+1] packed sample s is documents sample_docs[s]:sample_docs[s+1]
        doc_sources.npy int64 [D,2] document d came from meta["source_files"][doc_sources[d,0]],
                                    line (row, text block start) doc_sources[d,1]

A packed sample is whole documents only (a document never straddles two
samples), padded to ``seq_len`` when read. Position ids restart at 0 at every
document, which is how ``transformers`` recognises packed sequences and keeps
attention inside each document; padding gets labels -100, so it is never trained.
The first token of every document has label -100 too: nothing predicts across a
document boundary.

The directory is written under a temporary name and renamed into place, so a
reader never sees half a cache. Every reader checks it first
(:func:`verify_cache`): each array file's size, and a sha256 over a fixed sample
of its blocks (cheap at any size), against ``meta.json``. A truncated or
overwritten file is found before training, and prepare rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

FORMAT_VERSION = 2  # 2: doc_sources.npy and the "check" entry of meta.json
META_FILE = "meta.json"
SPLITS = ("train", "eval")
TOKENS, LABELS, DOC_OFFSETS, SAMPLE_DOCS = "tokens.npy", "labels.npy", "doc_offsets.npy", "sample_docs.npy"
DOC_SOURCES = "doc_sources.npy"
ARRAYS = (TOKENS, LABELS, DOC_OFFSETS, SAMPLE_DOCS, DOC_SOURCES)
CHECK_BLOCK = 1 << 16  # bytes hashed per sampled block
CHECK_BLOCKS = 32  # blocks sampled per file, evenly spaced, plus the last one
IGNORE_INDEX = -100  # the label of a token without loss (PyTorch's cross-entropy default)

JsonValue = Union[str, int, float, bool, None, List["JsonValue"], Dict[str, "JsonValue"]]


class CacheError(ValueError):
    """A cache is missing, incomplete, or of another format version; the message says what to run."""


def pack_documents(lengths: Sequence[int], seq_len: int) -> np.ndarray:
    """Group consecutive documents into samples of at most ``seq_len`` tokens, never splitting one.

    Args:
        lengths: token count of each document, in packing order (each at most ``seq_len``).
        seq_len: tokens per sample.

    Returns:
        ``sample_docs`` (int64, ``[S+1]``): sample s holds documents ``sample_docs[s]:sample_docs[s+1]``.

    Raises:
        ValueError: a document longer than ``seq_len`` (truncate or drop it first).
    """
    bounds = [0]
    used = 0
    for d, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"document {d} has {n} tokens, more than seq_len={seq_len}")
        if used + n > seq_len and used > 0:
            bounds.append(d)
            used = 0
        used += n
    if used > 0:
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def sampled_sha256(path: Path) -> str:
    """sha256 over a file's size and :data:`CHECK_BLOCKS` evenly spaced blocks plus its last block.

    Reads at most about 2 MiB whatever the size: cheap enough for every rank at every start.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        starts = sorted({min(i * size // CHECK_BLOCKS, max(size - CHECK_BLOCK, 0)) for i in range(CHECK_BLOCKS)}
                        | {max(size - CHECK_BLOCK, 0)})
        for start in starts:
            fh.seek(start)
            h.update(fh.read(CHECK_BLOCK))
    return h.hexdigest()


def check_entries(cache_dir: Path) -> Dict[str, Dict[str, JsonValue]]:
    """``{"train/tokens.npy": {"bytes": n, "sampled_sha256": hex}, ...}`` for every array file of the cache."""
    out: Dict[str, Dict[str, JsonValue]] = {}
    for split in SPLITS:
        for name in ARRAYS:
            p = cache_dir / split / name
            if p.is_file():
                out[f"{split}/{name}"] = {"bytes": p.stat().st_size, "sampled_sha256": sampled_sha256(p)}
    return out


def verify_cache(cache_dir: Path, meta: Dict[str, JsonValue]) -> None:
    """Check every array file of a cache against its metadata's sizes and sampled checksums.

    Args:
        cache_dir: the cache directory.
        meta: its ``meta.json``.

    Raises:
        CacheError: a file is missing, has another size, or another checksum (named, with both values).
    """
    expected = meta.get("check")
    if not isinstance(expected, dict) or not expected:
        raise CacheError(f"{cache_dir}: {META_FILE} records no sizes or checksums; prepare it again")
    problems: List[str] = []
    for rel, want in sorted(expected.items()):
        p = cache_dir / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = p.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"{rel} has {size} bytes, {META_FILE} says {want.get('bytes')} (truncated or replaced)")
        elif sampled_sha256(p) != want.get("sampled_sha256"):
            problems.append(f"{rel} does not match its checksum (its content changed after prepare)")
    if problems:
        raise CacheError(f"{cache_dir}: the token cache is damaged: " + "; ".join(problems) +
                         "; prepare it again (prepare rebuilds a damaged cache)")


def write_split(directory: Path, docs_tokens: Sequence[np.ndarray], docs_labels: Sequence[np.ndarray],
                seq_len: int, doc_sources: Optional[np.ndarray] = None) -> Dict[str, int]:
    """Write one split from per-document arrays (already in packing order).

    Args:
        directory: the split's directory (created).
        docs_tokens: int token ids of each document.
        docs_labels: the labels of each document (same lengths; -100 where no loss).
        seq_len: tokens per packed sample.
        doc_sources: int64 ``[D, 2]``, each document's (index into ``meta["source_files"]``, line).

    Returns:
        Counts: ``documents``, ``samples``, ``tokens``, ``trained_tokens``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray([len(t) for t in docs_tokens], dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(docs_tokens).astype(np.int32, copy=False) if len(docs_tokens) else np.zeros(0, np.int32)
    labels = np.concatenate(docs_labels).astype(np.int32, copy=False) if len(docs_labels) else np.zeros(0, np.int32)
    labels[offsets[:-1][lengths > 0]] = IGNORE_INDEX  # nothing predicts a document's first token
    sample_docs = pack_documents(lengths.tolist(), seq_len)
    np.save(directory / TOKENS, tokens)
    np.save(directory / LABELS, labels)
    np.save(directory / DOC_OFFSETS, offsets)
    np.save(directory / SAMPLE_DOCS, sample_docs)
    if doc_sources is None:
        doc_sources = np.full((len(lengths), 2), -1, dtype=np.int64)
    np.save(directory / DOC_SOURCES, np.asarray(doc_sources, dtype=np.int64).reshape(len(lengths), 2))
    return {"documents": int(len(lengths)), "samples": int(len(sample_docs) - 1), "tokens": int(tokens.size),
            "trained_tokens": int((labels != IGNORE_INDEX).sum())}


def commit_cache(tmp: Path, final: Path, meta: Dict[str, JsonValue]) -> Path:
    """Write ``meta.json`` into ``tmp`` and rename it to ``final``; another writer's finished cache wins.

    Returns:
        ``final``.
    """
    meta = {"format_version": FORMAT_VERSION, **meta, "check": check_entries(tmp)}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / META_FILE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a concurrent prepare finished the same key first
    return final


@dataclass
class Sample:
    """One packed sample, padded to ``seq_len``: what a rank feeds the model."""

    input_ids: np.ndarray  # int64 [seq_len]
    labels: np.ndarray  # int64 [seq_len], -100 where no loss (padding, prompts, document starts)
    position_ids: np.ndarray  # int64 [seq_len], restarting at 0 at every document (and for the padding)


class PackedSplit:
    """One split of a cache, memory-mapped; samples addressed by index."""

    def __init__(self, directory: Path, seq_len: int, pad_id: int) -> None:
        self.directory = directory
        self.seq_len = seq_len
        self.pad_id = pad_id
        try:
            self.tokens = np.load(directory / TOKENS, mmap_mode="r")
            self.labels = np.load(directory / LABELS, mmap_mode="r")
            self.doc_offsets = np.load(directory / DOC_OFFSETS, mmap_mode="r")
            self.sample_docs = np.load(directory / SAMPLE_DOCS, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise CacheError(f"{directory}: cannot read the token cache ({err}); prepare it again") from err

    @property
    def num_samples(self) -> int:
        return int(self.sample_docs.shape[0] - 1)

    def sample(self, index: int) -> Sample:
        """Sample ``index`` (0-based), padded to ``seq_len``."""
        first, last = int(self.sample_docs[index]), int(self.sample_docs[index + 1])
        bounds = np.asarray(self.doc_offsets[first:last + 1], dtype=np.int64)
        start, end = int(bounds[0]), int(bounds[-1])
        n = end - start
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        ids[:n] = self.tokens[start:end]
        labels[:n] = self.labels[start:end]
        positions = np.arange(self.seq_len, dtype=np.int64)
        # each document counts from 0; the padding is one more "document" of its own
        starts = np.repeat(bounds[:-1] - start, np.diff(bounds))
        positions[:n] -= starts
        positions[n:] -= n
        return Sample(ids, labels, positions)


class TokenCache:
    """A prepared cache directory: ``meta.json`` plus its splits, verified on opening.

    Raises:
        CacheError: the directory is not a complete cache of this format version, or a file is damaged.
    """

    def __init__(self, path: Path, pad_id: int, verify: bool = True) -> None:
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / META_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CacheError(f"{self.path}: not a complete token cache (no readable {META_FILE}): {err}") from err
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CacheError(f"{self.path}: cache format {self.meta.get('format_version')}, this version reads "
                             f"{FORMAT_VERSION}; prepare it again")
        if verify:
            verify_cache(self.path, self.meta)
        self.seq_len = int(self.meta["seq_len"])
        self.pad_id = pad_id

    def source_of(self, split: str, doc: int) -> Optional[str]:
        """``file:line`` of document ``doc`` of ``split`` (None when the cache does not know it)."""
        files = self.meta.get("source_files") or []
        try:
            index, line = (int(x) for x in np.load(self.path / split / DOC_SOURCES, mmap_mode="r")[doc])
        except (OSError, ValueError, IndexError):
            return None
        return f"{files[index]}:{line}" if 0 <= index < len(files) else None

    def split(self, name: str) -> Optional[PackedSplit]:
        """The ``train`` or ``eval`` split, or None when the cache has none (or it is empty)."""
        d = self.path / name
        if not (d / SAMPLE_DOCS).is_file():
            return None
        split = PackedSplit(d, self.seq_len, self.pad_id)
        return split if split.num_samples > 0 else None
