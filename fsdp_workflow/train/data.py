"""Training data: read documents, tokenise, pack into ``seq_len`` blocks, shard across ranks.

Packing without padding: every document is tokenised, followed by EOS, and the
documents are concatenated in a fixed shuffled order into one token stream that
is cut into blocks of exactly ``train.seq_len`` tokens. No position is padding.

Determinism and resume: a *sample index* ``i`` (counted over the whole job, all
ranks together) names block ``perm_e[i mod K]`` where ``K`` is the number of
blocks, ``e = i div K`` the epoch and ``perm_e`` a permutation seeded by
``(data.seed, e)``. The only position to checkpoint is the number of samples
consumed so far, so resuming, even with a different number of ranks, continues
the exact sequence of global batches. Rank ``r`` of ``W`` takes samples
``pos + r*B ... pos + r*B + B - 1`` of each global micro-batch (``B`` = micro-batch).

Sources: ``text`` (blank-line separated documents), ``jsonl``, ``parquet``
(needs pyarrow), ``hf_disk`` (``datasets.load_from_disk``; needs datasets) and
``synthetic`` (random ids, a pure function of the sample index).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence

import torch

from fsdp_workflow.config.schema import DataConfig, DataSource


class DataError(ValueError):
    """The data config points at nothing usable."""


def _expand(path: Optional[str], key: str, suffixes: Sequence[str]) -> List[str]:
    if not path:
        raise DataError(f"{key} is not set: give a file, directory or glob of {'/'.join(suffixes)} files.")
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if f.endswith(tuple(suffixes)))
    else:
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if os.path.isfile(path) else [])
    if not files:
        raise DataError(f"{key}={path!r} matches no {'/'.join(suffixes)} file. Fix the path (file, directory or glob).")
    return files


def read_documents(source: DataSource, path: Optional[str], text_field: str, key: str = "data.path") -> List[str]:
    """Read all documents of a file-based source as strings, in a stable order.

    Raises:
        DataError: nothing found, a record lacks ``text_field``, or a reader is not installed.
    """
    docs: List[str] = []
    if source == DataSource.text:
        for f in _expand(path, key, (".txt", ".md", ".text")):
            with open(f, encoding="utf-8") as fh:
                blocks = fh.read().split("\n\n")
            docs.extend(b.strip() for b in blocks if b.strip())
    elif source == DataSource.jsonl:
        for f in _expand(path, key, (".jsonl", ".json")):
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if text_field not in rec:
                        raise DataError(
                            f"{f}:{n}: no field {text_field!r} (fields: {sorted(rec)}). Set data.text_field."
                        )
                    docs.append(str(rec[text_field]))
    elif source == DataSource.parquet:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError("data.source=parquet needs pyarrow: pip install pyarrow") from e
        for f in _expand(path, key, (".parquet",)):
            table = pq.read_table(f)
            if text_field not in table.column_names:
                raise DataError(f"{f}: no column {text_field!r} (columns: {table.column_names}). Set data.text_field.")
            docs.extend(str(x) for x in table.column(text_field).to_pylist())
    elif source == DataSource.hf_disk:
        try:
            from datasets import load_from_disk
        except ImportError as e:
            raise DataError("data.source=hf_disk needs the datasets package: pip install datasets") from e
        if not path or not os.path.isdir(path):
            raise DataError(f"{key}={path!r} is not a directory written by datasets' save_to_disk.")
        ds = load_from_disk(path)
        if hasattr(ds, "keys"):  # a DatasetDict: take "train" (or the only split)
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        if text_field not in ds.column_names:
            raise DataError(f"{path}: no column {text_field!r} (columns: {ds.column_names}). Set data.text_field.")
        docs.extend(str(x) for x in ds[text_field])
    else:
        raise DataError(f"read_documents: source {source} has no files")
    if not docs:
        raise DataError(f"{key}={path!r}: no non-empty documents found.")
    return docs


def split_held_out(docs: List[str], fraction: float, seed: int) -> tuple[List[str], List[str]]:
    """Split documents into (train, held-out) by a seeded hash of their index: stable and rank-independent."""
    if fraction <= 0:
        return docs, []
    train: List[str] = []
    held: List[str] = []
    for i, d in enumerate(docs):
        h = int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") / 2**64
        (held if h < fraction else train).append(d)
    if not train:
        raise DataError(f"data.eval_fraction={fraction} left no training documents; lower it.")
    return train, held


def pack(docs: Iterable[str], tokenizer: Any, seq_len: int, add_eos: bool, seed: int) -> torch.Tensor:
    """Tokenise, shuffle the documents (seeded), concatenate with EOS and cut into ``seq_len`` blocks.

    Returns:
        An int64 tensor ``[num_blocks, seq_len]``; the tail shorter than a block is dropped.

    Raises:
        DataError: fewer tokens than one block.
    """
    docs = list(docs)
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = tokenizer([docs[i] for i in order], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    flat: List[int] = []
    for seq in ids:
        flat.extend(seq)
        if add_eos:
            flat.append(eos)
    n = len(flat) // seq_len
    if n == 0:
        raise DataError(f"the data holds {len(flat)} tokens, fewer than one block of train.seq_len={seq_len}.")
    return torch.tensor(flat[: n * seq_len], dtype=torch.int64).view(n, seq_len)


@dataclass
class PackedSource:
    """Blocks of token ids addressed by a global sample index (see the module docstring)."""

    blocks: Optional[torch.Tensor]  # [K, seq_len]; None for synthetic
    seq_len: int
    seed: int
    vocab_size: int = 0  # synthetic only
    _perm: Optional[tuple[int, torch.Tensor]] = None  # (epoch, permutation) cache

    def sample(self, index: int) -> torch.Tensor:
        """The ``seq_len`` token ids of global sample ``index``."""
        if self.blocks is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            return torch.randint(0, self.vocab_size, (self.seq_len,), generator=g, dtype=torch.int64)
        k = self.blocks.size(0)
        epoch, j = divmod(index, k)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = (epoch, torch.randperm(k, generator=g))
        return self.blocks[self._perm[1][j]]

    @property
    def num_blocks(self) -> Optional[int]:
        return None if self.blocks is None else self.blocks.size(0)


class RankBatches:
    """Per-rank micro-batches from a :class:`PackedSource`, resumable by sample position.

    Args:
        source: the packed data.
        micro_batch_size: sequences per rank per forward.
        rank: data-parallel rank.
        world: data-parallel world size.
        position: global samples already consumed (from the checkpoint; 0 at start).
    """

    def __init__(self, source: PackedSource, micro_batch_size: int, rank: int, world: int, position: int = 0):
        self.source = source
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world = world
        self.position = position

    def next(self) -> torch.Tensor:
        """The next ``[micro_batch_size, seq_len]`` batch of this rank; advances the global position."""
        start = self.position + self.rank * self.micro_batch_size
        batch = torch.stack([self.source.sample(start + j) for j in range(self.micro_batch_size)])
        self.position += self.world * self.micro_batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """The data position (a ``Stateful`` part); ``data_seed`` is a record, not restored."""
        return {"samples_consumed": self.position, "data_seed": self.source.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["samples_consumed"])


def build_sources(cfg: DataConfig, tokenizer: Any, seq_len: int, vocab_size: int) -> tuple[PackedSource, Optional[PackedSource]]:
    """Build the training source and the held-out one (None when there is none).

    Args:
        cfg: the ``data`` group.
        tokenizer: the model's tokenizer (unused for synthetic).
        seq_len: ``train.seq_len``.
        vocab_size: the model's vocabulary size (synthetic ids are drawn below it).
    """
    if cfg.source == DataSource.synthetic:
        return PackedSource(None, seq_len, cfg.seed, vocab_size), PackedSource(None, seq_len, cfg.seed + 1, vocab_size)
    docs = read_documents(cfg.source, cfg.path, cfg.text_field)
    if cfg.eval_path:
        train_docs = docs
        held_docs = read_documents(cfg.source, cfg.eval_path, cfg.text_field, key="data.eval_path")
    else:
        train_docs, held_docs = split_held_out(docs, cfg.eval_fraction, cfg.seed)
    train = PackedSource(pack(train_docs, tokenizer, seq_len, cfg.add_eos, cfg.seed), seq_len, cfg.seed)
    held: Optional[PackedSource] = None
    if held_docs:
        try:
            held = PackedSource(pack(held_docs, tokenizer, seq_len, cfg.add_eos, cfg.seed + 1), seq_len, cfg.seed + 1)
        except DataError:
            held = None  # too little held-out text for one block: no evaluation
    return train, held
