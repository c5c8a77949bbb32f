"""A router loss the family's forward never computes is refused at planning (issue 49, item 7).

    python -m pytest tests/config/test_router_loss_at_planning.py

Llama 4's text model keeps ``router_aux_loss_coef=0.001`` in its config, which
``model.router_aux_loss_coef=null`` takes, but its forward computes no load-balancing
loss: the trainer stopped at its first step ("this model's forward gave no router
logits"), after the queue and the data preparation. Planning now reads the family's
modeling file (``load_balancing_loss_func`` is never called) and refuses it with exit 2,
naming the fix, which then trains.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.config import hf_source
from fsdp_workflow.config.load import compose
from fsdp_workflow.core.exit_codes import EXIT_USAGE
from fsdp_workflow.plan.checks import check

ROOT = Path(__file__).resolve().parents[2]
SHORT = ("+experiment=smoke", "train.max_steps=2", "checkpoint.every_steps=2", "optimizer.warmup_steps=0",
         "consolidate.enabled=false")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_workflow", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT)), timeout=300)


@pytest.mark.slow
def test_llama4_text_is_refused_at_planning_and_the_fix_trains(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = cli(*SHORT, f"run_dir={run}", "model.model_type=llama4_text")
    assert res.returncode == EXIT_USAGE, res.stderr[-3000:]
    assert "model.router_aux_loss_coef = null" in res.stderr
    assert "null takes the model config's router_aux_loss_coef=0.001" in res.stderr
    assert "Llama4ForCausalLM's forward computes no router load-balancing loss" in res.stderr
    assert "fix: model.router_aux_loss_coef=0" in res.stderr and not run.exists()  # before the data, the queue
    ok = cli(*SHORT, f"run_dir={run}", "model.model_type=llama4_text", "model.router_aux_loss_coef=0")
    assert ok.returncode == 0, ok.stderr[-4000:]
    assert (run / "checkpoints" / "step-2").is_dir()


@pytest.mark.parametrize("model_type,coef", [("mixtral", "null"), ("mixtral", "0.01"), ("qwen2_moe", "null"),
                                             ("gpt_oss", "null"), ("llama4_text", "0")])
def test_families_that_compute_it_or_a_loss_turned_off_plan(model_type: str, coef: str) -> None:
    cfg = compose(["+experiment=smoke", f"model.model_type={model_type}", f"model.router_aux_loss_coef={coef}",
                   "run_dir=/tmp/never-written"])
    assert [i for i in check(cfg).errors if i.key == "model.router_aux_loss_coef"] == []


def test_an_explicit_coefficient_on_a_family_without_the_loss_is_refused_too() -> None:
    assert hf_source.computes_router_loss(hf_source.family("llama4_text")) is False
    cfg = compose(["+experiment=smoke", "model.model_type=llama4_text", "model.router_aux_loss_coef=0.02",
                   "run_dir=/tmp/never-written"])
    (issue,) = [i for i in check(cfg).errors if i.key == "model.router_aux_loss_coef"]
    assert issue.value == 0.02 and "never calls load_balancing_loss_func" in issue.why
