"""A finished run is complete only on the inputs it was trained on, and only with a newest checkpoint that is whole.

Issue 36, items 3 and 4: the same command after appending to the data file, or after
a shard of the final checkpoint was truncated, used to say "this run is complete ...
Nothing run" (exit 0) and keep the old model. The command is the real one
(``python -m fsdp_workflow``, forked); the checkpoints are real DCP saves.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import forked_cli  # tests/forked_cli.py
from fsdp_workflow.core.commands import hydra_value

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt"
# docs/training.md's resume rules, as one line of text (its quotes wrap across lines).
TRAINING_DOC = " ".join((ROOT / "docs" / "training.md").read_text().split())


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return forked_cli.run(args, cwd=cwd, env=dict(os.environ, HYDRA_FULL_ERROR="0"), timeout=120)


def save_step(step_dir: Path) -> None:
    """A real (tiny) DCP checkpoint in ``step_dir``: ``.metadata`` and a shard."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(64, dtype=torch.float32)}, checkpoint_id=str(step_dir), no_dist=True)


def finished_run(tmp_path: Path, max_steps: int = 4) -> tuple:
    """A run planned by the real command on a copy of the corpus, then given a final checkpoint and a model."""
    data = tmp_path / "corpus.txt"
    shutil.copy(CORPUS, data)
    run = tmp_path / "run"
    args = ["+experiment=smoke", f"data.path={hydra_value(str(data))}", f"run_dir={hydra_value(str(run))}",
            f"train.max_steps={max_steps}", "checkpoint.every_steps=2"]
    planned = cli(*args, "dry_run=true")
    assert planned.returncode == 0, planned.stderr
    save_step(run / "checkpoints" / f"step-{max_steps // 2}")
    save_step(run / "checkpoints" / f"step-{max_steps}")
    (run / "hf_model").mkdir()
    (run / "hf_model" / "config.json").write_text("{}")
    return run, data, args


def test_appended_data_is_never_called_complete_and_both_offered_commands_are_accepted(tmp_path: Path) -> None:
    run, data, args = finished_run(tmp_path)
    same = cli(*args)
    assert same.returncode == 0 and "this run is complete (trained to step 4" in same.stdout, same.stderr
    size = data.stat().st_size
    appended = "Another paragraph the user appended after the run ended.\n"
    with open(data, "a") as fh:
        fh.write(appended)
    config_before = (run / "config.yaml").read_bytes()
    changed = cli(*args)
    assert changed.returncode == 2, (changed.stdout, changed.stderr)
    assert "complete" not in changed.stdout, changed.stdout
    err = changed.stderr
    assert "data.path" in err and str(data) in err and f"{size} -> {size + len(appended)} bytes" in err, err
    assert "nothing was run" in err and not (run / "logs" / "train-local.log").exists()
    assert (run / "config.yaml").read_bytes() == config_before  # nothing rewritten
    # Both choices are whole commands; each is accepted by the planner as printed.
    fix = err.split("fix: ", 1)[1]
    new_dir = fix.split("new run directory: ", 1)[1].split("; or continue", 1)[0]
    resume = fix.split("is verified): ", 1)[1].strip().splitlines()[0]
    for offered in (new_dir, resume):
        words = shlex.split(offered)
        assert words[:3] == ["python", "-m", "fsdp_workflow"], offered
        ok = cli(*words[3:], "dry_run=true")
        assert ok.returncode == 0, (offered, ok.stderr)
    assert f"checkpoint.resume={run / 'checkpoints' / 'step-4'}" in resume and "train.max_steps=8" in resume
    assert f"run_dir={run}-2" in new_dir


def test_a_changed_model_directory_is_named(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    from fsdp_workflow.plan.inputs import changed_inputs, fingerprint_inputs
    from fsdp_workflow.config import compose

    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'r'}"])
    import dataclasses

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=str(model)))
    before = fingerprint_inputs(cfg)
    (model / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 3}')
    assert changed_inputs(before, fingerprint_inputs(cfg)) == \
        [f"model.name_or_path: {model / 'config.json'}: its content changed"]
    assert changed_inputs(None, fingerprint_inputs(cfg)) == []  # a run recorded before inputs were


@pytest.mark.slow
def test_a_truncated_final_checkpoint_is_set_aside_and_its_steps_trained_again(tmp_path: Path) -> None:
    """The same command after a shard of the final checkpoint was cut: not complete; step 4 is trained again."""
    from tests.train.runner import _process_env, cli_argv, metrics_steps

    run = tmp_path / "run"
    args = ["cluster.device=cpu", "train.seq_len=64", "train.max_steps=4", "checkpoint.every_steps=2",
            "checkpoint.keep_last=2", "consolidate.enabled=false"]
    first = subprocess.run(cli_argv(run, args), env=_process_env(), cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    shard = sorted((run / "checkpoints" / "step-4").glob("*.distcp"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    again = subprocess.run(cli_argv(run, args), env=_process_env(), cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run is complete" not in again.stdout, again.stdout
    assert "cannot be resumed" in again.stderr and str(shard) in again.stderr, again.stderr[-3000:]
    assert (run / "checkpoints" / "step-4.corrupt").is_dir()  # set aside by resume, never deleted
    from fsdp_workflow.core.checkpoint_health import checkpoint_problem

    assert checkpoint_problem(run / "checkpoints" / "step-4") is None  # trained again, whole
    assert metrics_steps(run)[-2:] == [3, 4]  # the lost steps, redone once each


def test_a_changed_tokenizer_is_named_and_an_older_record_is_not_compared_on_it(tmp_path: Path) -> None:
    """Issue 36: model.tokenizer was no part of the fingerprint, so a finished run on another tokenizer was complete."""
    import dataclasses

    from fsdp_workflow.config import compose
    from fsdp_workflow.plan.inputs import TOKENIZER_KEY, changed_inputs, fingerprint_inputs

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (tok / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'r'}"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer=str(tok)))
    before = fingerprint_inputs(cfg)
    assert set(before[TOKENIZER_KEY]) == {str(tok / "tokenizer.json"), str(tok / "tokenizer_config.json")}
    (tok / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')  # same size, another vocabulary
    assert changed_inputs(before, fingerprint_inputs(cfg)) == \
        [f"model.tokenizer: {tok / 'tokenizer.json'}: its content changed"]
    older = {k: v for k, v in before.items() if k != TOKENIZER_KEY}  # planned before the key was recorded
    assert changed_inputs(older, fingerprint_inputs(cfg)) == []
    # docs/training.md's resume rules say so, quoting the line the user sees.
    assert f"`{TOKENIZER_KEY}: DIR/tokenizer.json: its content changed`" in TRAINING_DOC


def test_resume_auto_onto_changed_data_is_warned(tmp_path: Path) -> None:
    """Issue 36: the same command after the data changed under an unfinished run resumed onto it without a word."""
    run, data, args = finished_run(tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-4")  # stopped at step 2 of 4: not finished
    shutil.rmtree(run / "hf_model")
    with open(data, "a") as fh:
        fh.write("A paragraph appended while the run was stopped.\n")
    again = cli(*args, "dry_run=true")
    assert again.returncode == 0, again.stderr
    err = again.stderr
    assert err.count("warning: checkpoint.resume = 'auto'") == 1, err
    assert f"from its step 2 on other inputs than it trained on so far: data.path: {data}:" in err, err
    assert f"run_dir={run}-2" in err
    # docs/training.md's resume rules quote the warning as it is printed.
    for words in ("warning: checkpoint.resume = 'auto'", "on other inputs than it trained on so far:",
                  "The data position and the schedule carry on from that step over the new data",
                  "to continue onto them on purpose, nothing"):
        assert words in " ".join(err.split()) and words in TRAINING_DOC, words
