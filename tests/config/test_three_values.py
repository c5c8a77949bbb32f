"""Three values that composed and failed only later are refused at planning (issue 24, item 11)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import forked_cli  # tests/forked_cli.py

from fsdp_workflow.config.load import compose
from fsdp_workflow.config.rules_run import ATTN_IMPLEMENTATIONS
from fsdp_workflow.plan.checks import check

ROOT = Path(__file__).resolve().parents[2]
WRONG = [
    (["data.format=text", "data.text_field=''"], "data.text_field"),
    (["checkpoint.resume=maybe"], "checkpoint.resume"),
    (["model.attn_implementation=flash_attention_9"], "model.attn_implementation"),
]


@pytest.mark.parametrize("overrides,key", WRONG, ids=[k for _, k in WRONG])
def test_the_wrong_value_is_an_error_naming_the_key(overrides, key) -> None:
    # a dry run: a missing path there is only a warning (it may exist on the cluster), a wrong value is not
    report = check(compose(["+experiment=smoke", "dry_run=true", *overrides]))
    assert report.keys() == [key]


@pytest.mark.parametrize("overrides,key", WRONG, ids=[k for _, k in WRONG])
def test_the_cli_exits_2_before_writing(overrides, key, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = forked_cli.run(["+experiment=smoke", *overrides, "dry_run=true", f"run_dir={run}"], cwd=ROOT,
                         env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)  # `python -m fsdp_workflow`, forked
    assert res.returncode == 2, res.stderr
    assert key in res.stderr and "fix:" in res.stderr and not run.exists()


@pytest.mark.parametrize("resume", ["auto", "none", "AUTO", "checkpoints/step-3", "/scratch/run/checkpoints/step-10"])
def test_resume_values_that_name_a_choice_or_a_path_still_plan_as_dry_runs(resume: str) -> None:
    report = check(compose(["+experiment=smoke", "dry_run=true", f"checkpoint.resume={resume}"]))
    assert "checkpoint.resume" not in report.keys()


def test_the_list_matches_what_the_installed_transformers_accepts() -> None:
    """Planning reads no transformers (it imports torch); this keeps its static list honest."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    accepted = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    assert set(ATTN_IMPLEMENTATIONS) <= accepted
    # everything transformers accepts for training is offered (paged attention serves generation only)
    assert {k for k in accepted if not k.startswith("paged|")} == set(ATTN_IMPLEMENTATIONS)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_its_package_here_is_a_warning_not_an_error() -> None:
    report = check(compose(["+experiment=smoke", "cluster.device=cuda", "dry_run=true",
                            "model.attn_implementation=flash_attention_2"]))
    assert "model.attn_implementation" not in report.keys()
    assert any(w.key == "model.attn_implementation" and "flash_attn" in w.why for w in report.warnings)


def test_flash_attention_on_cpu_is_refused() -> None:
    report = check(compose(["+experiment=smoke", "model.attn_implementation=flash_attention_2"]))
    assert report.keys() == ["model.attn_implementation"]
