"""Ulysses sequence parallelism without ranks: what the planner accepts, refuses and estimates, and the loader's slices.

Fast: no process group, no model. The multi-rank exactness is tests/train/test_ulysses_exact.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp_workflow.config.load import compose
from fsdp_workflow.config.rules_topology import kv_replication
from fsdp_workflow.data.cache import IGNORE_INDEX, Sample
from fsdp_workflow.plan.checks import check as validate
from fsdp_workflow.plan.estimate import estimate_memory, summary_lines
from fsdp_workflow.train.data import RankBatches

SMOKE4 = ["+experiment=smoke", "cluster.processes_per_node=4", "run_dir=/tmp/never-written"]


def errors(overrides: list[str]) -> dict[str, str]:
    return {i.key: f"{i.why} | fix: {i.fix}" for i in validate(compose([*SMOKE4, *overrides])).errors}


@pytest.mark.parametrize("heads,kv,cp,r", [
    (32, 8, 4, 1), (32, 8, 8, 1),  # Llama 3 8B: KV heads split
    (32, 8, 16, 2), (4, 2, 4, 2), (4, 1, 2, 2),  # fewer KV heads than cp: each repeated r times
    (12, 3, 4, 4), (6, 6, 3, 1),
    (4, 2, 3, None), (6, 2, 4, None),  # cp does not divide the query heads
])
def test_kv_heads_split_or_replicated(heads: int, kv: int, cp: int, r: int | None) -> None:
    assert kv_replication(heads, kv, cp) == r


def test_cp_plans_and_says_what_each_rank_holds() -> None:
    cfg = compose([*SMOKE4, "strategy.context_parallel_size=4"])
    assert validate(cfg).errors == []
    lines = summary_lines(cfg)
    assert "mesh         dp_replicate 1 x dp_shard 1 x cp 4 x tp 1" in lines
    assert ("context      ulysses, cp 4: 32 of 128 positions per rank; inside attention the whole sequence for 1 "
            "of 4 query heads and 1 of 2 KV heads repeated x2 (replicated: fewer KV heads than cp)") in lines


def test_refusals_name_key_value_reason_and_fix() -> None:
    got = errors(["strategy.context_parallel_size=4", "train.seq_len=126"])
    assert "train.seq_len" in got and "a train.seq_len divisible by 4" in got["train.seq_len"]
    got = errors(["strategy.context_parallel_size=2", "model.num_attention_heads=3", "model.num_key_value_heads=1",
                  "model.hidden_size=48"])
    assert "the 3 query heads must split evenly over the 2 context-parallel ranks" in got[
        "strategy.context_parallel_size"], got
    got = errors(["strategy.context_parallel_size=2", "model.attn_implementation=eager"])
    assert "fix: model.attn_implementation=sdpa" in got["model.attn_implementation"], got
    got = errors(["strategy.context_parallel_size=2", "model.model_type=gemma2", "model.architecture=Gemma2ForCausalLM",
                  "model.decoder_layer_cls=Gemma2DecoderLayer"])
    assert "attn_logit_softcapping" in got.get("strategy.context_parallel_size", ""), got
    got = errors(["strategy.context_parallel_size=2", "strategy.tensor_parallel_size=2"])
    assert "strategy.context_parallel_size" not in got, got  # 4 heads = tp 2 x cp 2; 1 KV head per tp rank, repeated


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_a_family_without_sdpa_is_told_cp_cannot_split_it_not_to_use_sdpa(model_type: str) -> None:
    """Issue 49, item 7: gpt_oss with cp was advised model.attn_implementation=sdpa, which the family refuses
    (and which planning then replaced by eager again): the advice went round in a circle."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", *SMOKE4, "dry_run=true",
                          f"model.model_type={model_type}", "strategy.context_parallel_size=2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "model.attn_implementation=sdpa" not in res.stderr, res.stderr
    assert "strategy.context_parallel_size = 2" in res.stderr and "does not support SDPA" in res.stderr, res.stderr
    assert "fix: strategy.context_parallel_size=1" in res.stderr
    fixed = errors([f"model.model_type={model_type}", "strategy.context_parallel_size=1"])
    assert not {"strategy.context_parallel_size", "model.attn_implementation"} & set(fixed), fixed


def test_estimate_divides_positions_by_cp() -> None:
    long = ["cluster=local", "cluster.device=cuda", "train.seq_len=32768", "train.mixed_precision=bf16"]
    one = estimate_memory(compose([*SMOKE4, *long]))
    four = estimate_memory(compose([*SMOKE4, *long, "strategy.context_parallel_size=4"]))
    assert four.params_gib == pytest.approx(one.params_gib)  # sharded over dp_shard x cp = 4 either way
    mask = 2 * 32768**2 / 2**30  # micro-batch 2: the whole sequences' packed-document masks, on every cp rank
    assert four.activations_gib == pytest.approx(one.activations_gib / 4 + mask)  # layers: positions / cp


class Packed:
    seed, seq_len = 0, 8

    def sample(self, index: int) -> Sample:
        ids = np.arange(8, dtype=np.int64) + 10 * index
        labels = ids.copy()
        labels[[0, 5]] = IGNORE_INDEX  # two documents: 0-4 and 5-7
        return Sample(ids, labels, np.array([0, 1, 2, 3, 4, 0, 1, 2]))


@pytest.mark.parametrize("cp", [2, 4])
def test_each_cp_rank_gets_its_slice_of_the_same_samples(cp: int) -> None:
    whole = RankBatches(Packed(), 2, 1, 2).next()
    parts = [RankBatches(Packed(), 2, 1, 2, seq_shard=(i, cp)).next() for i in range(cp)]
    for name in ("input_ids", "position_ids"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts], dim=1), getattr(whole, name))
    for i, p in enumerate(parts):  # the slice's labels and the next slice's first: each target on one rank
        n = 8 // cp
        want = torch.cat([whole.labels, torch.full((2, 1), IGNORE_INDEX)], dim=1)[:, i * n : (i + 1) * n + 1]
        assert torch.equal(p.labels, want)
    assert sum(int(p.num_trained()) for p in parts) == int(whole.num_trained())
