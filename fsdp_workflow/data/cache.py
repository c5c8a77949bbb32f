"""The token cache: tokenised, masked, packed data as memory-mapped numpy arrays.

Written once by the prepare step (:mod:`fsdp_workflow.data.prepare`), read by
every rank with ``np.load(..., mmap_mode="r")``, so RAM per rank does not grow
with the corpus. Readable with numpy alone (docs/data.md)::

    CACHE/                          one directory per cache key
      meta.json                     format_version, key, seq_len, counts, what built it
      train/ eval/                  one directory per split (eval/ may be absent)
        tokens.npy     int32 [T]    every document's token ids, documents back to back
        labels.npy     int32 [T]    the token id where it carries loss, else -100
                                    (aligned with tokens; the model shifts by one itself)
        doc_offsets.npy int64 [D+1] document d is tokens[doc_offsets[d]:doc_offsets[d+1]]
        sample_docs.npy int64 [S+1] packed sample s is documents sample_docs[s]:sample_docs[s+1]

A packed sample is whole documents only (a document never straddles two
samples), padded to ``seq_len`` when read. Position ids restart at 0 at every
document, which is how ``transformers`` recognises packed sequences and keeps
attention inside each document; padding gets labels -100, so it is never trained.
The first token of every document has label -100 too: nothing predicts across a
document boundary.

The directory is written under a temporary name and renamed into place, so a
reader never sees half a cache.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "eval")
TOKENS, LABELS, DOC_OFFSETS, SAMPLE_DOCS = "tokens.npy", "labels.npy", "doc_offsets.npy", "sample_docs.npy"
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


def write_split(directory: Path, docs_tokens: Sequence[np.ndarray], docs_labels: Sequence[np.ndarray],
                seq_len: int) -> Dict[str, int]:
    """Write one split from per-document arrays (already in packing order).

    Args:
        directory: the split's directory (created).
        docs_tokens: int token ids of each document.
        docs_labels: the labels of each document (same lengths; -100 where no loss).
        seq_len: tokens per packed sample.

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
    return {"documents": int(len(lengths)), "samples": int(len(sample_docs) - 1), "tokens": int(tokens.size),
            "trained_tokens": int((labels != IGNORE_INDEX).sum())}


def commit_cache(tmp: Path, final: Path, meta: Dict[str, JsonValue]) -> Path:
    """Write ``meta.json`` into ``tmp`` and rename it to ``final``; another writer's finished cache wins.

    Returns:
        ``final``.
    """
    meta = {"format_version": FORMAT_VERSION, **meta}
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
    """A prepared cache directory: ``meta.json`` plus its splits.

    Raises:
        CacheError: the directory is not a complete cache of this format version.
    """

    def __init__(self, path: Path, pad_id: int) -> None:
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / META_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CacheError(f"{self.path}: not a complete token cache (no readable {META_FILE}): {err}") from err
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CacheError(f"{self.path}: cache format {self.meta.get('format_version')}, this version reads "
                             f"{FORMAT_VERSION}; prepare it again")
        self.seq_len = int(self.meta["seq_len"])
        self.pad_id = pad_id

    def split(self, name: str) -> Optional[PackedSplit]:
        """The ``train`` or ``eval`` split, or None when the cache has none (or it is empty)."""
        d = self.path / name
        if not (d / SAMPLE_DOCS).is_file():
            return None
        split = PackedSplit(d, self.seq_len, self.pad_id)
        return split if split.num_samples > 0 else None
