"""``train.compile: null`` (the default) is settled at planning: on for FSDP2 on CUDA without tp/cp, off elsewhere.

    python -m pytest tests/config/test_device_defaults.py

The settled value is what the rules judge, what the estimate counts and what config.yaml
records; the plan's notes say why, and an explicit value is never changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import forked_cli  # tests/forked_cli.py
from fsdp_workflow.plan.checks import check
from fsdp_workflow.plan.estimate import estimate_memory

CUDA = "cluster.device=cuda"


@pytest.mark.parametrize("overrides,want,note", [
    ([CUDA], True, "null -> true (FSDP2 on CUDA"),
    ([CUDA, "strategy=fsdp1"], False, "null -> false (strategy.name=fsdp1"),
    ([CUDA, "strategy.tensor_parallel_size=2", "cluster.processes_per_node=2"], False, "(tensor parallelism"),
    ([CUDA, "strategy.context_parallel_size=2", "cluster.processes_per_node=2"], False, "(context parallelism"),
    (["cluster.device=cpu"], False, None),
    ([CUDA, "train.compile=false"], False, None),
    (["cluster.device=cpu", "train.compile=true"], True, None),
])
def test_settled_as_the_rule_says_and_noted(composed, overrides, want, note) -> None:
    cfg = composed(overrides)
    report = check(cfg)
    assert cfg.train.compile is want
    notes = [n for n in report.notes if n.startswith("train.compile")]
    assert notes == [] if note is None else (len(notes) == 1 and note in notes[0]), report.notes


def test_the_estimate_counts_the_settled_value(composed) -> None:
    settled = composed([CUDA])
    check(settled)
    eager = composed([CUDA, "train.compile=false"])
    check(eager)
    assert estimate_memory(settled).total_gib < estimate_memory(eager).total_gib  # compiled layers save less


def test_config_yaml_records_true_and_a_rerun_settles_the_same(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["+experiment=smoke", CUDA, "dry_run=true", f"run_dir={run_dir}"]
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    first = forked_cli.run(args, cwd=tmp_path, env=env, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "train.compile: null -> true" in first.stdout + first.stderr
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["compile"] is True
    again = forked_cli.run(args, cwd=tmp_path, env=env, timeout=120)
    assert again.returncode == 0, again.stderr  # the same command plans the same run: no "config differs"
