"""``python -m fsdp_workflow.replan RUN_DIR`` pointed at a directory that holds no run.

Replanning an edited config on a live Slurm chain is proven in tests/slurm/test_chain_guard.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_workflow.replan import main


def test_a_directory_without_a_run_exits_2_names_it_once_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fsdp_workflow.replan: {tmp_path}: no config.yaml here. Pass the run directory written by "
                   "`python -m fsdp_workflow ... dry_run=true run_dir=DIR` (or its config.yaml). Nothing changed.")
    assert list(tmp_path.iterdir()) == []
