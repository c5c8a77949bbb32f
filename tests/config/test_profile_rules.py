"""``train.profile_steps`` at validation: a window the run reaches, or exit 2 naming the key and the fix.

The profile itself (one real 2-rank run) is tests/train/test_profiler.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import forked_cli  # tests/forked_cli.py

from fsdp_workflow.config.validate import validate

KEY = "train.profile_steps"


@pytest.mark.parametrize("window, why, fix", [
    ("[3,2]", "FIRST (3) is after LAST (2)", f"{KEY}=[2,3]"),
    ("[0,2]", "steps count from 1", f"{KEY}=[3,4]"),
    ("[2,11]", "LAST (11) is beyond train.max_steps=10", f"{KEY}=[2,10], or a larger train.max_steps"),
    ("[2]", "expected two optimizer steps, [FIRST,LAST]", f"{KEY}=[3,4]"),
    ("[1,2,3]", "expected two optimizer steps, [FIRST,LAST]", f"{KEY}=[3,4]"),
])
def test_a_window_the_run_never_reaches_is_refused(composed, window: str, why: str, fix: str) -> None:
    report = validate(composed([f"{KEY}={window}", "train.max_steps=10"]))
    issue = next(i for i in report.errors if i.key == KEY)
    assert why in issue.why and issue.fix.startswith(fix), issue.format()


@pytest.mark.parametrize("window", ["[1,1]", "[3,10]", "null"])
def test_a_window_within_the_run_is_accepted(composed, window: str) -> None:
    assert KEY not in validate(composed([f"{KEY}={window}", "train.max_steps=10"])).keys()


@pytest.mark.parametrize("window, said", [("[4,2]", "FIRST (4) is after LAST (2)"), ("[a,2]", "not an integer")])
def test_the_command_exits_2_naming_the_key(tmp_path: Path, window: str, said: str) -> None:
    run_dir = tmp_path / "run"
    res = forked_cli.run(["+experiment=smoke", f"{KEY}={window}", f"run_dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert KEY in res.stderr and said in res.stderr and "Traceback" not in res.stderr
    assert not run_dir.exists()
