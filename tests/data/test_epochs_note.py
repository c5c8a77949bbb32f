"""Many epochs over a small dataset are said at planning and by prepare (issue 49, item 7).

    python -m pytest tests/data/test_epochs_note.py

``train.max_steps`` times the global batch, over the training samples: more than 3
passes were trained without a word. Planning counts the records (a packed sample
holds whole documents, so the epochs are at least steps x batch / records); prepare,
and planning after it, give the exact figure over the packed samples, with the
``train.max_steps`` for 3 epochs, which then plans without the note.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONPATH=str(ROOT))


def plan(run: Path, *overrides: str) -> str:
    res = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke_chat", "dry_run=true",
                          f"run_dir={run}", *overrides], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout + res.stderr


def epochs_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("epochs ")]
    assert len(lines) <= 1, out
    return lines[0] if lines else ""


def test_many_epochs_are_said_at_planning_and_by_prepare_and_the_fix_plans_without_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = plan(run, "train.max_steps=400")
    config = yaml.safe_load((run / "config.yaml").read_text())
    records = sum(1 for ln in Path(config["data"]["path"]).read_text().splitlines() if ln.strip())
    bound = 400 * 4 / records
    assert bound > 3, "the test needs a corpus small enough for 400 steps of 4 sequences"
    assert epochs_line(first).startswith(f"epochs       train.max_steps=400 x 4 sequences per step = 1,600 samples: "
                                         f"at least {bound:.1f} epochs over the {records:,} records")
    prep = subprocess.run([sys.executable, "-m", "fsdp_workflow.data.prepare", str(run), "--workers", "1"],
                          capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    cache = json.loads((run / "data.json").read_text())["cache"]
    samples = json.loads((Path(cache) / "meta.json").read_text())["splits"]["train"]["samples"]
    exact = f"{1600 / samples:.1f} epochs over the {samples:,} packed training samples"
    (said,) = [ln for ln in prep.stderr.splitlines() if "prepare: note: " in ln]
    assert exact in said, said
    fix = re.search(r"train\.max_steps=(\d+) for 3 epochs", said)
    assert fix and int(fix.group(1)) == 3 * samples // 4, said
    again = plan(run, "train.max_steps=400")  # an earlier prepare of this run: the exact figure
    assert exact in epochs_line(again)
    assert epochs_line(plan(tmp_path / "fixed", f"train.max_steps={fix.group(1)}")) == ""  # the fix: no note


def test_the_shipped_smoke_chat_run_is_not_noted(tmp_path: Path) -> None:
    assert epochs_line(plan(tmp_path / "run")) == ""
