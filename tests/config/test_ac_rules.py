"""``strategy.activation_checkpointing`` at the CLI: an unknown mode, the old boolean and a bad N exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.config.test_float8_rules import cli


@pytest.mark.parametrize("overrides, fragment", [
    (["strategy.activation_checkpointing=selective"], "why: not one of none, full, every_n_layers, ops"),
    # the boolean it was before: named, with the modes to choose from (true meant full)
    (["strategy.activation_checkpointing=true"], "why: not one of none, full, every_n_layers, ops"),
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


def test_every_mode_plans(tmp_path: Path) -> None:
    for mode in ("none", "full", "every_n_layers", "ops"):
        res = cli(f"strategy.activation_checkpointing={mode}", "dry_run=true", f"run_dir={tmp_path / mode}",
                  cwd=tmp_path)
        assert res.returncode == 0, res.stderr
