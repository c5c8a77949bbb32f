"""A tokenizer larger than the model's embedding is refused at planning, exit 2, nothing written (issue 24, item 12)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_workflow.config.load import compose
from fsdp_workflow.data.plan_checks import tokenizer_vocab_size
from fsdp_workflow.plan.checks import check

ROOT = Path(__file__).resolve().parents[2]
EXTRA = 40  # tokens added to the 260-id byte-level tokenizer: 300 ids


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tokenizer directory (save_pretrained) with more ids than the tiny models' 260 rows."""
    from fsdp_workflow.data.tokenizer import byte_level_tokenizer

    tok = byte_level_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(EXTRA - 1)])
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    out = tmp_path_factory.mktemp("tok") / "big"
    tok.save_pretrained(str(out))
    return out


def test_the_torch_free_reader_agrees_with_transformers(big_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(big_tokenizer))
    assert tokenizer_vocab_size(str(big_tokenizer)) == len(tok) == 260 + EXTRA


def test_the_rule_names_model_vocab_size_with_the_fix(big_tokenizer: Path) -> None:
    report = check(compose(["+experiment=smoke", f"model.tokenizer={big_tokenizer}"]))
    assert report.keys() == ["model.vocab_size"]
    assert report.errors[0].fix.startswith(f"model.vocab_size={260 + EXTRA}")
    fixed = check(compose(["+experiment=smoke", f"model.tokenizer={big_tokenizer}", f"model.vocab_size={260 + EXTRA}"]))
    assert "model.vocab_size" not in fixed.keys()


def test_the_built_in_tokenizer_against_a_small_embedding() -> None:
    assert check(compose(["+experiment=smoke", "model.vocab_size=200"])).keys() == ["model.vocab_size"]


def test_the_cli_exits_2_before_writing_and_answers_in_about_a_second(big_tokenizer: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", f"model.tokenizer={big_tokenizer}",
                          f"run_dir={run}"], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)
    took = time.monotonic() - start
    assert res.returncode == 2, res.stderr
    assert "model.vocab_size = 260" in res.stderr and "300 token ids" in res.stderr
    assert not run.exists()
    assert "transformers" not in res.stderr
    assert took < 10, took  # a whole interpreter start on a shared machine; about a second on a quiet one
