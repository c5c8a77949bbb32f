"""The one rule for where an output may go relative to its checkpoints (core/paths.py).

The planner (consolidate.output_dir) and the consolidation CLI (OUT) both call it; the
CLI's side is tested end to end in tests/consolidate/test_out_rules.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_workflow.core.paths import is_inside, output_overlap


def test_inside_and_apart(tmp_path: Path) -> None:
    src = tmp_path / "run" / "checkpoints"
    assert is_inside(src / "step-4" / "out", src)
    assert is_inside(src, src)
    assert not is_inside(tmp_path / "run" / "checkpoints-old", src)  # a shared prefix is not inside
    assert output_overlap(tmp_path / "run" / "hf_model", src) is None
    assert output_overlap(tmp_path / "elsewhere", src) is None


@pytest.mark.parametrize("where, word", [("run/checkpoints/step-4/out", "inside"), ("run/checkpoints", "itself"),
                                         ("run", "holds"), (".", "holds")])
def test_overlap_names_both_paths(tmp_path: Path, where: str, word: str) -> None:
    src = tmp_path / "run" / "checkpoints"
    out = tmp_path / where
    why = output_overlap(out, src)
    assert why is not None and word in why and str(src) in why


def test_symlink_cannot_hide_the_source(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    (tmp_path / "alias").symlink_to(src)
    assert "inside" in (output_overlap(tmp_path / "alias" / "out", src) or "")
    assert "holds" in (output_overlap(tmp_path, tmp_path / "alias") or "")


def test_empty_path_refused() -> None:
    assert output_overlap("  ", "/tmp/x") == "is an empty path"


def test_planner_uses_the_shared_rule(tmp_path: Path) -> None:
    """consolidate.output_dir inside RUN_DIR/checkpoints, or holding it, is refused by the planner with the same words."""
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.config.validate import validate

    run = tmp_path / "run"

    def problems(out: Path) -> list[str]:
        cfg = compose(["+experiment=smoke", f"run_dir={run}", f"consolidate.output_dir={out}"])
        return [i.format() for i in validate(cfg).errors if i.key == "consolidate.output_dir"]

    for out, word in ((run / "checkpoints" / "m", "inside"), (run, "holds"), (tmp_path, "holds")):
        found = problems(out)
        assert len(found) == 1 and word in found[0] and str(run / "checkpoints") in found[0], found
    assert problems(tmp_path / "model") == []


def test_a_run_directory_under_home_is_laid_out_there(monkeypatch, tmp_path) -> None:
    """A config.yaml (or an API caller) may spell run_dir with ~: every path hangs off the home directory."""
    from fsdp_workflow.core.rundir import RunDir

    monkeypatch.setenv("HOME", str(tmp_path))
    layout = RunDir.of("~/runs/r", log_dir="~/logs", output_dir="~/model")
    assert (layout.root, layout.logs, layout.hf_model) == (tmp_path / "runs/r", tmp_path / "logs", tmp_path / "model")
