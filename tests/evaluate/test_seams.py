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
    """evaluate reads the run through the run record (config/record.py): it loads no config and builds no layout itself."""
    callers = set()
    for path in Path(evaluate_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("load_run_config", "RunDir.of", "RunDir.recorded", "run_layout", "open", "run_record"):
                    callers.add((path.name, name))
    # eval_record.py appends to evals.jsonl (evaluate writes it); run.py asks the run record for the rest
    assert callers == {("run.py", "run_record"), ("eval_record.py", "open")}
