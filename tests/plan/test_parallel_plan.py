"""Planning the device mesh: the shipped llama70b_tp experiment (dry run) and the memory estimate's divisors."""

from __future__ import annotations

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.config.accelerate_env import read_launch_env
from fsdp_workflow.config.model_size import num_params
from fsdp_workflow.config.validate import validate
from fsdp_workflow.plan.checks import check
from fsdp_workflow.plan.estimate import GIB, estimate_memory, summary_lines
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.plan.run_dir import write_run_dir

SITE = ["cluster.partition=gpu", "data.path=/data/sft.jsonl"]


def test_llama70b_tp_plans_as_a_dry_run(tmp_path) -> None:
    """4 nodes x 8 GPUs, tp 8 in a node: 4-way data parallel, 1/32 of the weights per GPU, under 80 GiB."""
    cfg = compose(["+experiment=llama70b_tp", *SITE, "dry_run=true", f"run_dir={tmp_path / 'plan'}"])
    assert check(cfg).errors == []
    write_run_dir(cfg, backend_for(cfg))
    env = read_launch_env(tmp_path / "plan" / "launch.env")
    assert {k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")} == {
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4",
        "PARALLELISM_CONFIG_TP_SIZE": "8"}
    text = "\n".join(summary_lines(cfg))
    assert "mesh         dp_replicate 1 x dp_shard 4 x cp 1 x tp 8" in text
    assert "global batch 32 sequences = micro 1 x accum 8 x dp 4" in text
    est = estimate_memory(cfg)
    assert est.params_gib == pytest.approx(4 * num_params(cfg.model) / 32 / GIB)
    assert 65e9 < num_params(cfg.model) < 75e9 and est.total_gib < cfg.cluster.gpu_mem_gb


def test_estimate_divides_weights_over_tp_x_dp_shard_and_activations_over_tp() -> None:
    base = ["+experiment=llama8b_fft", *SITE, "cluster.nodes=1", "cluster.processes_per_node=8",
            "train.global_batch_size=null"]
    plain, tp, hybrid = (estimate_memory(compose([*base, *extra])) for extra in (
        [], ["strategy.tensor_parallel_size=2"],
        ["cluster.nodes=2", "strategy.dp_replicate_size=2", "strategy.tensor_parallel_size=2"]))
    assert tp.params_gib == pytest.approx(plain.params_gib)  # 2 x 4 = 8 shards either way
    assert hybrid.params_gib == pytest.approx(plain.params_gib)  # a replica: dp_shard 4 x tp 2
    assert hybrid.optimizer_gib == pytest.approx(plain.optimizer_gib)
    # The layers' activations halve; the logits (lm_head is not split over tp) do not.
    assert tp.activations_gib == pytest.approx(plain.activations_gib / 2)
    assert tp.logits_gib == pytest.approx(plain.logits_gib) and plain.logits_gib > 0
    assert validate(compose([*base, "strategy.tensor_parallel_size=2"])).errors == []


@pytest.mark.parametrize("strategy, words", [
    ("ddp", "mesh         none (ddp): 16 data-parallel rank(s); each holds the whole model (DDP replicas)"),
    ("fsdp1", "mesh         none (fsdp1): 16 data-parallel rank(s); FSDP1 shards the model over all of them"),
    ("deepspeed_zero3", "mesh         none (deepspeed_zero3): 16 data-parallel rank(s); DeepSpeed ZeRO stage 3 "
                        "over all of them"),
    ("fsdp2", "mesh         dp_replicate 1 x dp_shard 16 x cp 1 x tp 1"),
])
def test_the_summary_says_how_each_strategy_holds_the_model(strategy: str, words: str) -> None:
    """Only FSDP2 builds a device mesh; a DDP run's summary must not read as dp_shard 16."""
    text = "\n".join(summary_lines(compose(["+experiment=llama8b_fft", *SITE, f"strategy={strategy}"])))
    assert words in text.splitlines(), text
