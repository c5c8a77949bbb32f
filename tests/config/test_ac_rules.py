"""``strategy.activation_checkpointing`` at the CLI: an unknown mode, the old boolean and a bad N exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import forked_cli
from tests.config.test_float8_rules import cli


@pytest.mark.parametrize("overrides, fragment", [
    (["strategy.activation_checkpointing=selective"], "why: not one of none, full, every_n_layers, ops"),
    (["strategy.activation_checkpointing=every_n_layers", "strategy.activation_checkpointing_every_n_layers=5"],
     "tiny-llama has only 2"),
    (["strategy.activation_checkpointing=every_n_layers", "strategy.activation_checkpointing_every_n_layers=1"],
     "strategy.activation_checkpointing_every_n_layers"),
    (["strategy.activation_checkpointing_every_n_layers=4"], "only activation_checkpointing=every_n_layers reads it"),
])
def test_invalid_values_exit_2_naming_the_key(tmp_path: Path, overrides: list[str], fragment: str) -> None:
    run_dir = tmp_path / "run"
    res = cli(*overrides, f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "strategy.activation_checkpointing" in res.stderr and fragment in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not run_dir.exists()


@pytest.mark.parametrize("given, recorded", [("true", "full"), ("false", "none"), ("False", "none")])
def test_the_boolean_it_was_before_plans_on_the_command_line_as_in_a_file(tmp_path: Path, given: str,
                                                                          recorded: str) -> None:
    """Issue 36, item 6: true is full and false is none, on the command line as in a config.yaml."""
    from fsdp_workflow.config import load_run_config

    run_dir = tmp_path / "run"
    res = cli(f"strategy.activation_checkpointing={given}", "dry_run=true", f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert load_run_config(run_dir).strategy.activation_checkpointing.value == recorded
    assert f"activation_checkpointing: {recorded}" in (run_dir / "config.yaml").read_text()


def test_every_mode_plans(tmp_path: Path) -> None:
    for mode in ("none", "full", "every_n_layers", "ops"):
        res = cli(f"strategy.activation_checkpointing={mode}", "dry_run=true", f"run_dir={tmp_path / mode}",
                  cwd=tmp_path)
        assert res.returncode == 0, res.stderr


def _user_experiment(tmp_path: Path, value: str) -> list[str]:
    """A user's experiment file, found through ``hydra.searchpath``, holding ``activation_checkpointing: VALUE``."""
    where = tmp_path / "my conf"
    (where / "experiment").mkdir(parents=True, exist_ok=True)
    (where / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - smoke\n  - _self_\n"
        f"strategy:\n  activation_checkpointing: {value}\n")
    return ["experiment=mine", f"hydra.searchpath=[file://{where}]"]


def _plan(tmp_path: Path, *args: str) -> forked_cli.subprocess.CompletedProcess:
    return forked_cli.run(list(args), cwd=tmp_path, env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)


def test_the_boolean_in_a_user_experiment_file_plans_as_on_the_command_line(tmp_path: Path) -> None:
    """Issue 36, item 6: Hydra refused the boolean in a YAML file (an Enum node takes no bool) before our
    upgrade could run; it now plans exactly as the command line's, and a config.yaml holding it is that run."""
    from fsdp_workflow.config import compose, load_run_config

    by_file, by_cli = tmp_path / "file", tmp_path / "cli"
    res = _plan(tmp_path, *_user_experiment(tmp_path, "false"), "dry_run=true", f"run_dir={by_file}")
    assert res.returncode == 0, res.stderr
    cli_res = _plan(tmp_path, "experiment=smoke", "strategy.activation_checkpointing=false", "dry_run=true",
                    f"run_dir={by_cli}")
    assert cli_res.returncode == 0, cli_res.stderr
    assert "activation_checkpointing: none\n" in (by_file / "config.yaml").read_text()
    assert ((by_file / "config.yaml").read_text().replace(str(by_file), "RUN")
            == (by_cli / "config.yaml").read_text().replace(str(by_cli), "RUN"))
    assert res.stderr.replace(str(by_file), "RUN") == cli_res.stderr.replace(str(by_cli), "RUN")  # same notes

    # true is full, through the same composition (in process: the compose API).
    cfg = compose([*_user_experiment(tmp_path, "true"), f"run_dir={by_file}"])
    assert cfg.strategy.activation_checkpointing.value == "full"

    # A config.yaml holding the boolean, as an earlier version wrote it, loads as that run's config.
    from fsdp_workflow.config.load import to_yaml

    record = by_file / "config.yaml"
    planned = record.read_text()
    record.write_text(planned.replace("activation_checkpointing: none\n", "activation_checkpointing: false\n"))
    assert to_yaml(load_run_config(by_file)) == planned


def test_a_value_outside_the_choices_in_a_user_experiment_file_is_refused_with_the_others(tmp_path: Path) -> None:
    """The command line's refusal (exit 2, test_invalid_values_exit_2_naming_the_key) for a file's value."""
    from fsdp_workflow.config.load import compose_collecting

    _, issues = compose_collecting([*_user_experiment(tmp_path, "sometimes"), f"run_dir={tmp_path / 'run'}"])
    assert [(i.key, i.value, i.why) for i in issues] == [
        ("strategy.activation_checkpointing", "sometimes", "not one of none, full, every_n_layers, ops")]
