"""The run record (:mod:`fsdp_workflow.config.record`): one typed read side of a run directory.

Real files in a tmp run directory, written as the planner, the trainer, the evaluations and
the consolidator write them (the config composed through the schema).
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_workflow.config.load import compose, to_yaml
from fsdp_workflow.config.record import open_run, read_steps
from fsdp_workflow.core.modeldir import VERIFICATION_FILE
from fsdp_workflow.core.rundir import RunDir


def _run(tmp_path: Path, *overrides: str) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config.write_text(to_yaml(compose(["+experiment=smoke", f"run_dir={run.root}", *overrides])))
    return run


def test_a_step_logged_twice_counts_once_the_later_record_winning_in_every_series(tmp_path: Path) -> None:
    """Issue 18's rule, for metrics.jsonl and evals.jsonl alike: one reader."""
    run = _run(tmp_path)
    run.metrics.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 3.0}, {"step": 2, "loss": 9.9}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.0}]) + "\n")
    run.evals_file.write_text("\n".join(json.dumps(r) for r in [
        {"step": 10, "status": "failed"}, {"step": 5, "status": "ok", "loss": 2.2}, {"step": 10, "status": "ok", "loss": 2.1}]) + "\n")
    rec = open_run(run.root)
    assert rec.metrics.steps == [1, 2, 3] and rec.metrics.get(2) == {"step": 2, "loss": 2.5}
    assert rec.evals.steps == [5, 10] and rec.evals.get(10) == {"step": 10, "status": "ok", "loss": 2.1}
    assert rec.evals.last() == rec.evals.get(10) and rec.metrics.up_to(2).steps == [1, 2]
    assert rec.problems == []


def test_broken_lines_are_named_and_a_line_being_written_is_not(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n[1]\n{"step": "2"}\n{"step": 3}\n{"step": 4, "lo')
    series = read_steps(path)
    assert series.steps == [1, 3]
    assert series.problems == [f"{path}:2: not JSON", f"{path}:3: not a step record (no integer \"step\")",
                               f"{path}:4: not a step record (no integer \"step\")"]
    assert read_steps(tmp_path / "missing.jsonl").steps == []


def test_the_config_is_typed_and_sets_the_layout(tmp_path: Path) -> None:
    out = tmp_path / "models" / "final"
    run = _run(tmp_path, "train.max_steps=7", f"consolidate.output_dir={out}", "cluster.log_dir=/tmp/elsewhere")
    rec = open_run(run.root)
    assert rec.config is not None and rec.config.train.max_steps == 7
    assert rec.layout.hf_model == out and rec.layout.logs == Path("/tmp/elsewhere")
    assert rec.model.path == out and rec.model.state == "absent"


def test_a_config_that_does_not_load_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config.write_text("train: {max_steps: [\n")
    rec = open_run(run.root)
    assert rec.config is None and rec.config_problem.startswith(f"{run.config}: not YAML (")
    assert rec.problems == [rec.config_problem]
    run.config.write_text("train: {max_steps: 3}\n")  # a fragment: the schema's mandatory groups are missing
    rec = open_run(run.root)
    assert rec.config is None and "does not load as this version's config" in rec.config_problem
    assert rec.layout.root == run.root  # the layout still comes (RunDir's defaults)


def test_provenance_exits_checkpoints_and_models(tmp_path: Path) -> None:
    run = _run(tmp_path, "train.ema_decay=0.9")
    run.provenance.write_text(json.dumps({"git_revision": "abc"}))
    run.train_exit.write_text(json.dumps({"exit_code": "0"}))
    run.jobs.write_text("train 11\nconsolidate 12\n")
    run.job_exits.mkdir()
    run.job_exit("consolidate", "12").write_text(json.dumps({"exit_code": 0}))
    (run.step_dir(5)).mkdir(parents=True)
    (run.step_dir(5) / ".metadata").write_text("")
    run.hf_model.mkdir()
    (run.hf_model / VERIFICATION_FILE).write_text(json.dumps({"ok": True, "sources": [str(run.step_dir(5))]}))
    run.hf_model_ema.mkdir()
    (run.hf_model_ema / VERIFICATION_FILE).write_text("{torn")
    rec = open_run(run.root)
    assert rec.provenance == {"git_revision": "abc"} and rec.jobs == [("train", "11"), ("consolidate", "12")]
    assert rec.job_exit("consolidate", "12") == {"exit_code": 0} and rec.job_exit("train", "11") is None
    assert rec.train_exit == {"exit_code": "0"} and rec.checkpoints == [(5, run.step_dir(5))]
    assert rec.model.state == "verified" and rec.model.source_dirs == [run.step_dir(5)]
    assert rec.model_ema.state == "present (unreadable verification.json)"
    assert rec.problems[0] == f"{run.train_exit}: no integer exit_code (found '0')"
    assert rec.problems[1].startswith(f"{run.hf_model_ema / VERIFICATION_FILE}: not JSON")


def test_a_config_written_before_selective_checkpointing_still_loads(tmp_path):
    """config.yaml of a run planned by an earlier version held a bool: it still loads, as full/none."""
    import yaml

    from fsdp_workflow.config import compose
    from fsdp_workflow.config.load import load_run_config, to_yaml

    for old, new in ((True, "full"), (False, "none")):
        data = yaml.safe_load(to_yaml(compose(["+experiment=smoke"])))
        data["strategy"]["activation_checkpointing"] = old
        path = tmp_path / f"{old}.yaml"
        path.write_text(yaml.safe_dump(data))
        assert load_run_config(path).strategy.activation_checkpointing.value == new
