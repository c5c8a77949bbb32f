"""evaluate uses the trainer through its public face only, and reads the run directory in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp_workflow.evaluate as evaluate_pkg
from tests.test_imports import _graph

TRAIN_PUBLIC = {"fsdp_workflow.train.heldout", "fsdp_workflow.train.trackers"}  # trackers: log_checkpoint_eval


def test_evaluate_imports_nothing_else_of_the_trainer() -> None:
    used = {dst for src, dsts in _graph().items() if src.startswith("fsdp_workflow.evaluate")
            for dst in dsts if dst.startswith("fsdp_workflow.train")}
    assert used == TRAIN_PUBLIC


def test_only_open_run_loads_the_run_config() -> None:
    """``load_run_config`` and ``RunDir.of`` are called in evaluate/run.py alone (core/run.py will take it over)."""
    callers = set()
    for path in Path(evaluate_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("load_run_config", "RunDir.of", "RunDir.recorded", "run_layout", "open"):
                    callers.add((path.name, name))
    assert callers == {("run.py", "load_run_config"), ("run.py", "RunDir.of"), ("record.py", "open")}
