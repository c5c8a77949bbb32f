"""Trainer data: the token cache memory-mapped, batches of (ids, labels, positions), a resumable seeded order."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List

import numpy as np
import torch

from fsdp_workflow.data.cache import TokenCache
from fsdp_workflow.data.tokenizer import byte_level_tokenizer
from fsdp_workflow.train.data import Batch, CacheSource, RankBatches, SyntheticSource, pad_token_id
from tests.train.caches import PAD, build_cache


def _docs(n: int, length: int = 3) -> List[List[int]]:
    return [[10 * i + j for j in range(length)] for i in range(n)]


def test_batches_carry_labels_and_restarting_positions(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "c", [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], seq_len=6,
                        trained=[[True] * 3, [False, True], [False, False, True, True, True]])
    src = CacheSource(cache.split("train"), seed=0)
    assert src.num_samples == 2  # [1 2 3 | 4 5] and [6 7 8 9 10], each padded to 6
    order = [src.sample(i).input_ids[0] for i in range(2)]
    first = int(np.flatnonzero(np.asarray(order) == 1)[0])
    batch = RankBatches(src, 2, 0, 1).next()
    assert isinstance(batch, Batch) and all(t.dtype == torch.int64 and t.shape == (2, 6) for t in
                                            (batch.input_ids, batch.labels, batch.position_ids))
    ids, labels, pos = (t[first].tolist() for t in (batch.input_ids, batch.labels, batch.position_ids))
    assert ids == [1, 2, 3, 4, 5, PAD]
    assert pos == [0, 1, 2, 0, 1, 0]  # restart at each document; the padding is a document of its own
    assert labels == [-100, 2, 3, -100, 5, -100]  # document starts, the prompt token and padding: no loss
    other = batch.labels[1 - first].tolist()
    assert other == [-100, -100, 8, 9, 10, -100]
    assert int(batch.num_trained()) == 3 + 3


def test_every_sample_once_per_epoch_and_resume_on_another_world(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "c", _docs(10), seq_len=3)  # one document per sample
    src = CacheSource(cache.split("train"), seed=1)
    ranks = [RankBatches(src, 2, r, 2) for r in range(2)]
    seen = [torch.cat([ranks[r].next().input_ids for r in range(2)]) for _ in range(5)]  # 20 samples: 2 epochs
    firsts = torch.cat(seen)[:, 0].tolist()
    assert sorted(firsts[:10]) == sorted(firsts[10:]) == list(range(0, 100, 10))
    assert firsts[:10] != firsts[10:]  # a new permutation each epoch
    assert firsts[:10] != list(range(0, 100, 10))  # shuffled
    # Resume at step 3 with ONE rank of micro-batch 4: the same global samples follow.
    state = ranks[0].state_dict()
    assert set(state) == {"samples_consumed", "data_seed"} and state["data_seed"] == 1
    solo = RankBatches(CacheSource(cache.split("train"), seed=1), 4, 0, 1)
    solo.load_state_dict({"samples_consumed": state["samples_consumed"] - 8})
    assert torch.equal(solo.next().input_ids, seen[3]) and torch.equal(solo.next().input_ids, seen[4])


def test_the_order_depends_on_the_seed_only(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "c", _docs(16), seq_len=3)
    a, b, c = (CacheSource(cache.split("train"), seed=s) for s in (4, 4, 5))
    take = lambda src: [int(src.sample(i).input_ids[0]) for i in range(16)]  # noqa: E731
    assert take(a) == take(b) != take(c)


def test_no_eval_split_is_none(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "c", _docs(4), seq_len=3)
    assert cache.split("eval") is None
    with_eval = build_cache(tmp_path / "d", _docs(4), seq_len=3, eval_docs=_docs(2))
    assert with_eval.split("eval").num_samples == 2


def test_synthetic_is_a_function_of_the_index() -> None:
    src = SyntheticSource(16, seed=5, vocab_size=260)
    a, b = src.sample(7), src.sample(7)
    assert np.array_equal(a.input_ids, b.input_ids) and not np.array_equal(a.input_ids, src.sample(8).input_ids)
    assert int(a.input_ids.max()) < 260
    assert np.array_equal(a.labels, a.input_ids) and a.position_ids.tolist() == list(range(16))
    batch = RankBatches(src, 3, 1, 2).next()
    assert batch.input_ids.shape == (3, 16) and int(batch.num_trained()) == 3 * 15


def test_pad_id_is_the_pad_token_else_eos() -> None:
    tok = byte_level_tokenizer()
    assert pad_token_id(tok) == tok.pad_token_id == PAD

    class NoPad:
        pad_token_id = None
        eos_token_id = 257

    assert pad_token_id(NoPad()) == 257


def _anon_rss_kib() -> int:
    """This process's private resident memory (heap, numpy arrays), without mapped files."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_rank_maps_the_corpus_instead_of_loading_it(tmp_path: Path) -> None:
    """The split's arrays are np.memmap, and drawing batches allocates no copy of the corpus.

    Pages of the mapped files that a rank touched show in its RSS as *file* pages:
    the page cache, shared by the ranks of a node and evictable, not a rank's
    own memory. So the test measures the private (anonymous) part.
    """
    num_docs, length, seq_len = 40_000, 200, 1024  # 8M tokens: 32 MiB of tokens + 32 MiB of labels
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(num_docs, length), dtype=np.int64)
    build_cache(tmp_path / "big", list(tokens), seq_len=seq_len)
    del tokens
    before = _anon_rss_kib()
    split = TokenCache(tmp_path / "big", PAD).split("train")
    assert split is not None
    for arr in (split.tokens, split.labels, split.doc_offsets, split.sample_docs):
        assert isinstance(arr, np.memmap)
    batches = RankBatches(CacheSource(split, seed=0), 4, 0, 1)
    for _ in range(20):
        batches.next()
    grown_mib = (_anon_rss_kib() - before) / 1024
    assert grown_mib < 8, f"opening and reading the cache grew private RSS by {grown_mib:.1f} MiB (corpus: 64 MiB)"
    assert os.path.getsize(split.directory / "tokens.npy") > 30 * 2**20


def test_a_run_without_prepared_data_names_the_prepare_command(tmp_path: Path) -> None:
    """The trainer never prepares: no cache is exit code 2 and the command to run, before any model is built."""
    import subprocess
    import sys

    from tests.train.runner import launch_env, make_run_dir

    run = make_run_dir(tmp_path / "run", prepare_data=False)
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.train", str(run)], env=launch_env(run),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"python -m fsdp_workflow.data.prepare {run}" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Recorded as every other exit is, for status and the job script (train/loop.refusals_recorded).
    record = json.loads((run / "train_exit.json").read_text())
    assert record["exit_code"] == 2 and f"python -m fsdp_workflow.data.prepare {run}" in record["reason"], record
