"""Strategy switching through config alone: DDP on CPU; clear errors for what cannot run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from fsdp_workflow.train.parallel import StrategyError, check_strategy_available, requested_strategy
from tests.train.runner import launch, log_text, make_run_dir

ENV_KEYS = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION")


@pytest.mark.slow
def test_ddp_through_config(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path / "run", [
        "strategy=ddp", "train.max_steps=8", "train.grad_accum_steps=2", "checkpoint.every_steps=4",
        "optimizer.lr=3e-3",
    ])
    assert "ACCELERATE_USE_FSDP='false'" in (run / "launch.env").read_text() or \
        "ACCELERATE_USE_FSDP=false" in (run / "launch.env").read_text()
    proc = launch(run)
    assert proc.returncode == 0, log_text(run)
    assert "strategy ddp (DistributedType.MULTI_CPU)" in log_text(run)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < recs[0]["loss"]
    md = FileSystemReader(str(run / "checkpoints" / "step-8")).read_metadata()
    q = md.state_dict_metadata["model.model.layers.0.self_attn.q_proj.weight"]
    assert [tuple(c.sizes) for c in q.chunks] == [tuple(q.size)]  # replicated: one full chunk
    assert not any(k.startswith("model.module.") for k in md.state_dict_metadata)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "fsdp2"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp1"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "deepspeed"),
        ({}, "ddp"),
    ],
)
def test_requested_strategy_reads_env(monkeypatch: pytest.MonkeyPatch, env: dict, expected: str) -> None:
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert requested_strategy() == expected


def test_fsdp1_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(StrategyError, match="strategy=fsdp2"):
        check_strategy_available("fsdp1", "cpu")
    check_strategy_available("fsdp1", "cuda")


def test_deepspeed_errors_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    with pytest.raises(StrategyError, match="needs CUDA"):
        check_strategy_available("deepspeed", "cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(StrategyError, match="pip install"):
        check_strategy_available("deepspeed", "cuda")
