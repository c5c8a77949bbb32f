"""Conversations end to end on 2 gloo ranks: prepare -> train on assistant tokens only -> held-out perplexity."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.core.rundir import RunDir
from tests.train.runner import launched, make_run_dir

pytestmark = pytest.mark.slow

SEQ_LEN, MICRO, ACCUM, WORLD = 256, 2, 2, 2
CHAT = ["data=smoke_chat", f"train.seq_len={SEQ_LEN}", f"train.micro_batch_size={MICRO}",
        f"train.grad_accum_steps={ACCUM}", "train.max_steps=6", "train.eval_every_steps=3", "train.eval_batches=2",
        "checkpoint.every_steps=0", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launched(make_run_dir(tmp_path_factory.mktemp("chat") / "run", CHAT))


def test_only_assistant_tokens_are_trained(chat_run: Path) -> None:
    recs = [json.loads(line) for line in (chat_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    input_tokens = WORLD * ACCUM * MICRO * SEQ_LEN
    for r in steps:
        assert math.isfinite(r["loss"]) and 0 < r["trained_tokens"] < input_tokens / 2, r
    evals = [r["eval_loss"] for r in steps if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(e) for e in evals)


def test_perplexity_reads_the_held_out_split(chat_run: Path, tmp_path: Path) -> None:
    from fsdp_workflow.evaluate.perplexity import MAX_EVAL_SAMPLES, perplexity

    out = tmp_path / "hf_model"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(chat_run), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = load_run_config(chat_run)
    held = open_cache(RunDir.of(chat_run), pad_id=258).split("eval")
    assert held is not None
    n = min(held.num_samples, MAX_EVAL_SAMPLES)
    from fsdp_workflow.train.data import CacheSource

    src = CacheSource(held, cfg.data.seed + 1)  # the order the trainer evaluates in
    trained = sum(int((src.sample(i).labels[1:] != -100).sum()) for i in range(n))
    result = perplexity(out, cfg)
    assert result is not None and result["num_tokens"] == trained
    assert math.isfinite(result["loss"]) and result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    last_eval = [json.loads(line) for line in (chat_run / "metrics.jsonl").read_text().splitlines()][-1]["eval_loss"]
    assert abs(result["loss"] - last_eval) < 0.5, (result, last_eval)  # bf16, and a superset of the samples
