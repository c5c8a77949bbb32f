"""``strategy.activation_checkpointing`` at the CLI: an unknown mode, the old boolean and a bad N exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

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
