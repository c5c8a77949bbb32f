"""One message, exit 2, for every config problem (issue 24, items 10 and 12).

- Hydra's composition errors (a YAML syntax error in a user's experiment file,
  an option a group does not have) are one message naming the file (and line),
  without a traceback unless ``log_level=DEBUG`` or ``HYDRA_FULL_ERROR=1``.
- Unknown keys are reported with every other problem, not instead of them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import forked_cli  # tests/forked_cli.py

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, full_error: str = "0") -> subprocess.CompletedProcess:
    return forked_cli.run(args, cwd=ROOT, env=dict(os.environ, HYDRA_FULL_ERROR=full_error),
                          timeout=120)  # `python -m fsdp_workflow ARGS`, forked


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    """A user's config directory (README: hydra.searchpath) with a broken experiment file."""
    exp = tmp_path / "my_conf" / "experiment"
    exp.mkdir(parents=True)
    (exp / "broken.yaml").write_text("# @package _global_\ntrain:\n  max_steps: 3\n  micro_batch_size: [1, 2\n")
    return tmp_path / "my_conf"


def test_a_yaml_syntax_error_names_the_file_and_line(user_conf: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = cli(f"hydra.searchpath=[file://{user_conf}]", "+experiment=broken", "dry_run=true", f"run_dir={run}")
    assert res.returncode == 2, res.stderr
    assert str(user_conf / "experiment" / "broken.yaml") in res.stderr and "line 4" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 3, res.stderr
    assert not run.exists()


def test_an_unknown_key_in_a_users_experiment_file_is_named_with_the_likely_fix(user_conf: Path,
                                                                                 tmp_path: Path) -> None:
    (user_conf / "experiment" / "typo.yaml").write_text("# @package _global_\ntrain:\n  max_stepz: 5\n")
    res = cli(f"hydra.searchpath=[file://{user_conf}]", "+experiment=typo", "dry_run=true",
              f"run_dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "fsdp_workflow: invalid config", "  In 'experiment/typo': train.max_stepz",
        "    why: unknown key: 'train' has no 'max_stepz'", "    fix: did you mean train.max_steps? (in that file)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", [("log_level=DEBUG",), ("HYDRA_FULL_ERROR=1",)], ids=lambda h: h[0])
def test_the_traceback_only_when_asked_for(user_conf: Path, tmp_path: Path, how) -> None:
    extra = [how[0]] if how[0].startswith("log_level") else []
    res = cli(f"hydra.searchpath=[file://{user_conf}]", "+experiment=broken", "dry_run=true",
              f"run_dir={tmp_path / 'run'}", *extra, full_error="1" if not extra else "0")
    assert res.returncode == 2, res.stderr
    assert "Traceback" in res.stderr and "broken.yaml" in res.stderr


@pytest.mark.parametrize("override,group,option", [("+experiment=nope", "experiment", "nope"),
                                                   ("model=nope", "model", "nope")])
def test_an_unknown_group_option_is_one_message(override: str, group: str, option: str, tmp_path: Path) -> None:
    res = cli(override, "dry_run=true", f"run_dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr
    assert f"Could not find '{group}/{option}'" in res.stderr and "Available options" in res.stderr
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR" not in res.stderr
    assert "_schema" not in res.stderr  # the typed schemas are not options to pick
    assert not (tmp_path / "run").exists()


def test_unknown_keys_are_reported_with_every_other_problem(tmp_path: Path) -> None:
    """The example of docs/configuration.md, run as written: its output is the doc's, line for line."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    block = doc.split("$ python -m fsdp_workflow train.max_stepz=3 model.num_key_value_heads=5\n", 1)[1]
    expected = block.split("```", 1)[0].strip()
    res = cli("train.max_stepz=3", "model.num_key_value_heads=5", f"run_dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr
    assert "found 2 problems" in res.stderr, res.stderr
    assert res.stderr.strip() == expected
    assert not (tmp_path / "run").exists()


def test_an_unknown_plus_key_is_reported_with_the_others(tmp_path: Path) -> None:
    res = cli("+experiment=smoke", "+train.max_stepz=3", "train.micro_batch_size=0", "dry_run=true",
              f"run_dir={tmp_path / 'run'}")
    assert res.returncode == 2 and "found 2 problems" in res.stderr, res.stderr
    assert "train.max_stepz" in res.stderr and "train.micro_batch_size" in res.stderr


@pytest.mark.parametrize("override, lines", [
    ("strategy.name=zero3", ["strategy.name = 'zero3'", "why: not one of fsdp2, fsdp1, ddp, deepspeed_zero1, "
                             "deepspeed_zero2, deepspeed_zero3", "fix: strategy.name=deepspeed_zero3 (the closest)"]),
    ("hydra.mode=BOGUS", ["hydra.mode = 'BOGUS'", "why: not one of RUN, MULTIRUN",
                          "fix: hydra.mode=RUN (or another of these)"]),
    ("train.max_steps=abc", ["train.max_steps = 'abc'", "why: not an integer", "fix: train.max_steps=<integer>"]),
])
def test_a_value_of_the_wrong_kind_is_one_issue_with_its_fix(override: str, lines: list, tmp_path: Path) -> None:
    res = cli("+experiment=smoke", override, "dry_run=true", f"run_dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr
    assert [ln.strip() for ln in res.stderr.strip().splitlines()] == ["fsdp_workflow: invalid config", *lines]
    assert not (tmp_path / "run").exists()
