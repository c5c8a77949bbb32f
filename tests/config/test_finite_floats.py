"""Every float the config reads must be finite: nan, inf and -inf are refused by key (issue 24, item 1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked_cli  # tests/forked_cli.py

from fsdp_workflow.config.load import compose
from fsdp_workflow.config.rules_finite import NONFINITE_WHY, floats
from fsdp_workflow.plan.checks import check

ROOT = Path(__file__).resolve().parents[2]
# Every float the smoke experiment holds (found by walking the typed tree), plus the
# optional ones that are null there and a float inside a free-form section.
FLOAT_KEYS = sorted({k.split("[", 1)[0] for k, _ in floats(compose(["+experiment=smoke"]))}
                    | {"train.peak_tflops", "train.ema_decay", "+model.extra_config.attention_dropout"})


def test_the_walk_finds_the_floats_that_matter() -> None:
    assert {"optimizer.lr", "optimizer.eps", "optimizer.betas", "model.rope_theta"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_refuses_a_non_finite_value_naming_the_key(key: str, value: str) -> None:
    if key == "optimizer.betas":  # a list of floats
        value = f"[0.9,{value}]"
    report = check(compose(["+experiment=smoke", f"{key}={value}"]))
    name = key.lstrip("+")
    assert [i.key for i in report.errors] == [name]  # one message, not also its consequences
    assert report.errors[0].why.startswith(NONFINITE_WHY)
    assert "=" in report.errors[0].fix and "nan" not in report.errors[0].fix.lower()


def test_a_non_finite_list_item_is_refused() -> None:
    report = check(compose(["+experiment=smoke", "optimizer.betas=[0.9,inf]"]))
    assert report.keys() == ["optimizer.betas"] and "[0.9,0.95]" in report.errors[0].fix


def test_lr_inf_exits_2_naming_the_key_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = forked_cli.run(["+experiment=smoke", "dry_run=true", f"run_dir={run_dir}", "optimizer.lr=inf"], cwd=ROOT,
                         env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)  # `python -m fsdp_workflow`, forked
    assert res.returncode == 2, res.stderr
    assert "optimizer.lr = inf" in res.stderr and NONFINITE_WHY in res.stderr
    assert not run_dir.exists()
