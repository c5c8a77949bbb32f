"""``sweep.json``: the index of a Hydra multirun sweep (``python -m fsdp_workflow -m ...``).

Hydra's basic sweeper runs the points one after another in this process; each
point plans (and submits, or runs locally) a whole chain in its own run
directory under the sweep directory. Before the first point runs, every point
is validated (``fsdp_workflow.__main__``) and, when the sweep directory is
known, the index lists them all as planned; after each point it gains that
point's run directory and job ids. ``python -m fsdp_workflow.status SWEEP_DIR``
reads it back. The file is rewritten atomically, so a reader never sees half.

    {"sweep_dir": "/scratch/lr-sweep",
     "points": [{"num": 0, "overrides": ["optimizer.lr=1e-05"], "run_dir": "/scratch/lr-sweep/0",
                 "jobs": {"prepare": "101", "train": "102", "consolidate": "103"}, "exit_code": 0}, ...]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from fsdp_workflow.core.rundir import SWEEP_FILE, RunDir, atomic_write_json, read_sweep_index


def _put(index: Dict[str, Any], point: Dict[str, Any]) -> None:
    index["points"] = sorted([p for p in index["points"] if p.get("num") != point["num"]] + [point],
                             key=lambda p: p["num"])


def record_planned(sweep_dir: Path, points: Sequence[tuple]) -> None:
    """List every validated point, ``(overrides, run dir)`` in Hydra's order, before any runs."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    index = read_sweep_index(sweep_dir)
    for num, (overrides, run_dir) in enumerate(points):
        _put(index, {"num": num, "overrides": list(overrides), "run_dir": run_dir, "jobs": {}, "exit_code": None})
    atomic_write_json(sweep_dir / SWEEP_FILE, index)


def record_point(sweep_dir: Path, num: int, overrides: List[str], run_dir: Path, exit_code: Optional[int]) -> None:
    """After point ``num`` planned and submitted (or ran): its run directory, job ids and exit code."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    index = read_sweep_index(sweep_dir)
    jobs = {role: job for role, job in RunDir.of(run_dir).submitted_jobs()}
    _put(index, {"num": num, "overrides": list(overrides), "run_dir": str(run_dir), "jobs": jobs,
                 "exit_code": exit_code})
    atomic_write_json(sweep_dir / SWEEP_FILE, index)
