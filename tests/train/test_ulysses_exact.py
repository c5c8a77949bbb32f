"""Ulysses sequence parallelism on real gloo ranks: cp > 1 computes what cp = 1 computes (issue 39).

Two runs of ranks (tests/forked_ranks.py) running the trainer's own pieces (tests/train/ulysses_ranks.py: the
mesh, the loss forward with the Ulysses attention, FSDP2 over ``dp_shard x cp``, the data
loader's slices, the loop's loss scale) against cp = 1 on the same global batch, for a
Llama, a Qwen3 and a Qwen3-MoE replica (tests/families rows), on samples packing three
documents and padding, one document across the cut between cp slices:

* ``two_ranks``: cp 2 on 2 ranks, each family; and a packed sample's summed loss under
  cp 2 against its documents' losses each alone (the isolation mask intact);
* ``four_ranks``: cp 2 x dp_shard 2 for each family (Qwen3 under activation checkpointing,
  so the attention's collectives run again in backward); cp 4 (2 KV heads for 4 ranks:
  replicated x2); cp 2 x tp 2 (1 KV head per TP rank, replicated x2); dp_replicate 2 x
  cp 2 (HSDP).

And one real run of the command's trainer (``torchrun -m fsdp_workflow.train``): cp 2 on 2
ranks for 2 steps with a checkpoint after each, then its step-1 checkpoint resumed with
cp 1 (dp_shard 2, micro-batch 1: the same global batch). The resumed step 2 is the cp = 1
reference for the cp 2 run's step 2: the same state, the same samples.

Tolerances (fp32). cp changes only the order of sums (the all-to-alls move values, they
add nothing; FSDP's reduce-scatter adds 2 or 4 partial gradients instead of one; the
loss is summed in slices). Measured: step losses within 6e-7 of 5.5 (about 1e-7
relative), gradients within 3e-8 of elements up to 0.13. ``LOSS_RTOL = 1e-6`` and
``GRAD_ATOL = 1e-6`` leave ten to thirty times that, while a real mistake is far
larger: a gradient not summed over cp halves it (about 0.05 off), a document attending
across a boundary moves the loss by about 1e-2, a router loss computed per slice or
scaled by cp moves the expert gradients by about 1e-4 (coefficient 0.1 in these runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.conftest import copy_run
from tests.train.runner import launched, log_text, make_run_dir, write_config
from tests.train.ulysses_ranks import FOUR_RANKS, TWO_RANKS, Case, run

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-6
GRAD_ATOL = 1e-6
FAMILIES = ("llama-3.1", "qwen3-untied", "qwen3-moe")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(2, TWO_RANKS, tmp_path_factory.mktemp("ulysses2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(4, FOUR_RANKS, tmp_path_factory.mktemp("ulysses4"))


def assert_exact(results: dict, case: Case) -> None:
    got = results[case.name]
    assert got["loss"] == pytest.approx(got["reference_loss"], rel=LOSS_RTOL), got
    assert got["grad_max_abs_diff"] <= GRAD_ATOL, got
    assert got["grad_max_abs"] > 1e-2, got  # gradients that mean something


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_on_two_ranks_equals_cp1(two_ranks: dict, family: str) -> None:
    assert_exact(two_ranks, Case(family, 1, 2, docs_alone=family == "llama-3.1"))


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_by_dp_shard2_on_four_ranks_equals_cp1(four_ranks: dict, family: str) -> None:
    assert_exact(four_ranks, Case(family, 2, 2, checkpointing=family == "qwen3-untied"))


def test_moe_router_loss_is_trained_over_the_whole_sequence(four_ranks: dict) -> None:
    assert four_ranks[Case("qwen3-moe", 2, 2).name]["router_aux_coef"] == 0.1


def test_kv_heads_replicated_when_fewer_than_cp(four_ranks: dict) -> None:
    assert_exact(four_ranks, Case("llama-3.1", 1, 4))  # 4 query heads, 2 KV heads, cp 4


def test_cp_composes_with_tp_and_with_replicas(four_ranks: dict) -> None:
    assert_exact(four_ranks, Case("llama-3.1", 1, 2, tp=2))
    assert_exact(four_ranks, Case("qwen3-untied", 1, 2, dp_replicate=2))


def test_packed_documents_stay_apart_under_cp(two_ranks: dict) -> None:
    got = two_ranks[Case("llama-3.1", 1, 2, docs_alone=True).name]
    assert got["packed_sum"] == pytest.approx(got["documents_alone_sum"], rel=LOSS_RTOL), got


# ---------------------------------------------------------------- the trainer, end to end
CP2 = ["strategy.context_parallel_size=2", "train.micro_batch_size=2", "train.max_steps=2",
       "checkpoint.every_steps=1", "checkpoint.keep_last=0", "train.eval_every_steps=2"]
CP1 = [*CP2[1:], "train.micro_batch_size=1"]


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "step" in r}


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launched(make_run_dir(tmp_path_factory.mktemp("cp2") / "run", CP2))


@pytest.fixture(scope="module")
def resumed_cp1(cp2_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cp2_run``'s step-1 checkpoint resumed with cp 1 (dp_shard 2, micro-batch 1: the same global batch)."""
    run_dir = copy_run(cp2_run, tmp_path_factory.mktemp("cp1") / "run", checkpoints=(1,))
    write_config(run_dir, CP1)
    return launched(run_dir)


def test_trainer_cp2_step_equals_cp1_from_the_same_checkpoint(cp2_run: Path, resumed_cp1: Path) -> None:
    assert "mesh dp_replicate 1 x dp_shard 1 x cp 2 x tp 1" in log_text(cp2_run)
    assert "mesh dp_replicate 1 x dp_shard 2 x cp 1 x tp 1" in log_text(resumed_cp1)
    a, b = metrics(cp2_run)[2], metrics(resumed_cp1)[2]
    assert a["trained_tokens"] == b["trained_tokens"] and a["samples_consumed"] == b["samples_consumed"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5), (a, b)
