"""The plan's memory estimate against measured peaks: each run of fixtures/measured_peaks.csv.

Each row is a real training run's ``torch.cuda.max_memory_allocated`` and its config
overrides on top of :data:`BASE`. The estimate of a ``current`` row must lie within
-5% .. +10% of the peak (an underestimate is an out-of-memory after hours in the queue;
an overestimate a run not tried); a ``superseded`` row (the code it measured has since
changed) must still not be more than 5% under. A GPU run joins by adding a row. Pure
computation: composes configs, imports no torch.
"""

from __future__ import annotations

import ast
import csv
from pathlib import Path
from typing import Dict, List

import pytest

from fsdp_workflow.config.load import compose
from fsdp_workflow.plan.estimate import LOSS_CHUNK_TOKENS, estimate_memory

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "measured_peaks.csv"
UNDER, OVER = -0.05, 0.10

# Llama-3.2-1B's shape, untied (1.50 B parameters), seq 2048 x micro-batch 4, FSDP2 on one GPU, bf16, fused
# AdamW: the overrides of ../shared/gpu-bench (ours_run.py) that bear on memory.
BASE = ["+experiment=smoke", "model.init=random", "model.model_type=llama", "model.hidden_size=2048",
        "model.num_hidden_layers=16", "model.vocab_size=128256", "model.num_attention_heads=32",
        "model.num_key_value_heads=8", "model.intermediate_size=8192", "model.max_position_embeddings=2048",
        "model.tie_word_embeddings=false", "model.attn_implementation=sdpa", "data=synthetic", "strategy=fsdp2",
        "optimizer=adamw", "cluster.device=cuda", "cluster.processes_per_node=1", "cluster.nodes=1",
        "train.seq_len=2048", "train.micro_batch_size=4", "train.grad_accum_steps=1",
        "train.mixed_precision=bf16", "run_dir=/nonexistent/estimate"]


def rows() -> List[Dict[str, str]]:
    with open(FIXTURE, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@pytest.mark.parametrize("row", rows(), ids=lambda r: r["name"])
def test_estimate_within_bounds_of_the_measured_peak(row: Dict[str, str]) -> None:
    assert row["status"] in ("current", "superseded") and row["machine"] and row["date"] and row["source"]
    est = estimate_memory(compose([*BASE, *row["overrides"].split()]))
    peak = float(row["peak_gib"])
    error = est.total_gib / peak - 1
    parts = (f"estimate {est.total_gib:.2f} GiB against {peak} measured ({error:+.1%}): params "
             f"{est.params_gib:.2f}, grads {est.grads_gib:.2f}, optimizer {est.optimizer_gib:.2f}, gathered "
             f"{est.gathered_gib:.2f}, activations {est.activations_gib:.2f}, logits {est.logits_gib:.2f}")
    assert error >= UNDER, parts
    if row["status"] == "current":
        assert error <= OVER, parts


def test_the_loss_chunk_is_the_trainers() -> None:
    """estimate.LOSS_CHUNK_TOKENS is train/loss.py's chunk_tokens default (read from the source: no torch here)."""
    tree = ast.parse((ROOT / "fsdp_workflow/train/loss.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "install_chunked_loss_forward")
    names = [a.arg for a in fn.args.args]
    default = fn.args.defaults[names.index("chunk_tokens") - (len(names) - len(fn.args.defaults))]
    assert ast.literal_eval(default) == LOSS_CHUNK_TOKENS
