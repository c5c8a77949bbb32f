"""Training data: samples from the prepared token cache, in a seeded order, sharded across ranks.

The trainer never tokenises. The prepare step (``python -m fsdp_workflow.data.prepare
RUN_DIR``) wrote a cache of memory-mapped arrays (:mod:`fsdp_workflow.data.cache`);
every rank maps it, so RAM per rank does not grow with the corpus, and start-up
does not depend on its size. A packed sample is whole documents padded to
``train.seq_len``, with labels (``-100`` where no loss) and position ids that
restart at every document.

Determinism and resume: a *sample index* ``i`` (counted over the whole job, all
ranks together) names packed sample ``perm_e[i mod K]`` of the split, where ``K``
is its number of samples, ``e = i div K`` the epoch and ``perm_e`` a permutation
seeded by ``(data.seed, e)``. The only position to checkpoint is the number of
samples consumed so far, so resuming, even with a different number of ranks,
continues the exact sequence of global batches. Data-parallel rank ``r`` of ``W``
takes samples ``pos + r*B ... pos + r*B + B - 1`` of each global micro-batch
(``B`` = micro-batch). ``r`` and ``W`` count data-parallel ranks
(:attr:`fsdp_workflow.train.mesh.TrainMesh.dp_rank`), not processes: the
tensor-parallel peers of a rank take the very same samples. Context-parallel peers
(``cp > 1``) take the same samples too, each its own contiguous slice of the
positions (``seq_len / cp`` of them, with their position ids): see
:meth:`RankBatches.next`.

``data.source=synthetic`` needs no cache: random ids, a pure function of the
sample index, every token trained, positions ``0..seq_len-1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Protocol, Tuple

import numpy as np
import torch

from fsdp_workflow.config.schema import DataSource, WorkflowConfig, run_layout
from fsdp_workflow.data.cache import IGNORE_INDEX, CacheError, PackedSplit, Sample

PREPARE_COMMAND = "python -m fsdp_workflow.data.prepare {run_dir}"


class DataError(ValueError):
    """The run has no usable data (no prepared cache, or one prepared for another config)."""


@dataclass
class Batch:
    """One rank's micro-batch: three ``[micro_batch, seq_len]`` int64 tensors.

    ``labels`` are aligned with ``input_ids`` (the loss shifts by one itself) and
    hold ``-100`` where a token carries no loss (one column more under cp: the next
    slice's first label); ``position_ids`` restart at 0 at
    every packed document, which is what keeps attention inside a document.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in (self.input_ids, self.labels, self.position_ids)))

    def num_trained(self) -> torch.Tensor:
        """How many positions carry loss (a target other than -100 after the shift), as a tensor."""
        return (self.labels[:, 1:] != IGNORE_INDEX).sum()


class SampleSource(Protocol):
    """Packed samples addressed by a global sample index (any non-negative integer)."""

    seed: int
    seq_len: int

    def sample(self, index: int) -> Sample:
        ...


class CacheSource:
    """One split of the token cache, visited in a seeded order, epoch after epoch.

    Args:
        split: the memory-mapped split.
        seed: the permutation seed (``data.seed``; the held-out split uses ``data.seed + 1``).
    """

    def __init__(self, split: PackedSplit, seed: int) -> None:
        self.split = split
        self.seed = seed
        self.seq_len = split.seq_len
        self._perm: Optional[Tuple[int, np.ndarray]] = None  # (epoch, permutation): one epoch at a time

    @property
    def num_samples(self) -> int:
        return self.split.num_samples

    def sample(self, index: int) -> Sample:
        """Global sample ``index``: packed sample ``perm_epoch[index mod K]`` of the split."""
        epoch, j = divmod(index, self.num_samples)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g).numpy())
        return self.split.sample(int(self._perm[1][j]))


class SyntheticSource:
    """Random token ids, a pure function of the sample index; every token trained (benchmarks).

    Args:
        seq_len: tokens per sample.
        seed: ``data.seed`` (the held-out source uses ``data.seed + 1``).
        vocab_size: ids are drawn below it.
    """

    def __init__(self, seq_len: int, seed: int, vocab_size: int) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.num_samples: Optional[int] = None  # unbounded

    def sample(self, index: int) -> Sample:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=g, dtype=torch.int64).numpy()
        return Sample(ids, ids.copy(), np.arange(self.seq_len, dtype=np.int64))


class RankBatches:
    """Per-rank micro-batches from a :class:`SampleSource`, resumable by sample position.

    Args:
        source: the packed data.
        micro_batch_size: sequences per rank per forward.
        rank: data-parallel rank.
        world: data-parallel world size.
        position: global samples already consumed (from the checkpoint; 0 at start).
        seq_shard: ``(index, count)``: this rank holds slice ``index`` of ``count`` equal slices of
            every sample's positions (the cp rank and size; ``(0, 1)``: whole samples).
    """

    def __init__(self, source: SampleSource, micro_batch_size: int, rank: int, world: int, position: int = 0,
                 seq_shard: Tuple[int, int] = (0, 1)):
        self.source = source
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world = world
        self.position = position
        self.seq_shard = seq_shard

    def next(self) -> Batch:
        """The next ``[micro_batch_size, seq_len]`` batch of this rank; advances the global position.

        With ``seq_shard=(i, n)``, ``n > 1``: positions ``i*L ... (i+1)*L - 1`` (``L = seq_len / n``) of
        the same samples, and ``L + 1`` labels: the slice's own and the next slice's first (``-100``
        after the last slice), so that the slice's last position has its target and every target
        of the sample is counted on exactly one rank.
        """
        start = self.position + self.rank * self.micro_batch_size
        samples = [self.source.sample(start + j) for j in range(self.micro_batch_size)]
        self.position += self.world * self.micro_batch_size
        ids, labels, pos = (torch.from_numpy(np.stack([getattr(s, f) for s in samples]))
                            for f in ("input_ids", "labels", "position_ids"))
        index, count = self.seq_shard
        if count == 1:
            return Batch(ids, labels, pos)
        length = ids.size(1) // count
        a, b = index * length, (index + 1) * length
        labels = torch.cat([labels, labels.new_full((labels.size(0), 1), IGNORE_INDEX)], dim=1)
        return Batch(ids[:, a:b], labels[:, a : b + 1], pos[:, a:b])

    def state_dict(self) -> Dict[str, int]:
        """The data position (a ``Stateful`` part); ``data_seed`` is a record, not restored."""
        return {"samples_consumed": self.position, "data_seed": self.source.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.position = int(state["samples_consumed"])


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills a packed sample after its last document: the tokenizer's pad token, else EOS.

    Padding is never trained (label -100) and attends only to itself (its own
    position run), so its id only has to be a valid embedding row.
    """
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def open_sources(cfg: WorkflowConfig, pad_id: int) -> Tuple[SampleSource, Optional[SampleSource]]:
    """The training source and the held-out one (None when the cache has no eval split).

    Args:
        cfg: the run's config (``data``, ``train.seq_len``, ``model.vocab_size``, ``run_dir``).
        pad_id: the token id padding a packed sample (:func:`pad_token_id`).

    Returns:
        ``(train, held_out)``: the cache's ``train`` and ``eval`` splits, or synthetic sources.

    Raises:
        DataError: no cache was prepared for this run, or it was packed for another ``seq_len``;
            the message names the command that prepares it.
    """
    seq_len = cfg.train.seq_len
    if cfg.data.source == DataSource.synthetic:
        vocab = cfg.model.vocab_size
        return SyntheticSource(seq_len, cfg.data.seed, vocab), SyntheticSource(seq_len, cfg.data.seed + 1, vocab)
    from fsdp_workflow.data.open import open_cache

    layout = run_layout(cfg)
    fix = "run `" + PREPARE_COMMAND.format(run_dir=layout.root) + "` first (the prepare job of the chain)"
    try:
        cache = open_cache(layout, pad_id)
        train = cache.split("train") if cache is not None else None
        held = cache.split("eval") if cache is not None else None
    except CacheError as err:  # its message already names the command
        raise DataError(str(err)) from err
    if cache is None or train is None:
        raise DataError(f"{layout.data_pointer}: no training samples prepared for "
                        f"data.source={cfg.data.source.value}; {fix}")
    if cache.seq_len != seq_len:
        raise DataError(f"{cache.path} was packed for seq_len={cache.seq_len}, but train.seq_len={seq_len}; {fix}")
    return CacheSource(train, cfg.data.seed), (CacheSource(held, cfg.data.seed + 1) if held is not None else None)
