"""``python -m fsdp_workflow.evaluate RUN_DIR STEP`` on checkpoints of a real 2-rank run.

One gloo FSDP2 run of the tiny Llama (the session fixture ``ema_run`` of tests/conftest.py,
shared with tests/train/test_ema.py: 6 steps, a checkpoint every step, an EMA of the weights,
5% of the smoke corpus held out) gives real DCP checkpoints and a real token cache. Each figure evaluate reports is recomputed here on another path: the weights
loaded from the checkpoint with DCP itself (no consolidator), the held-out split read from the
cache (no trainer code), the loss summed with ``F.cross_entropy``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.data.open import open_cache
from fsdp_workflow.evaluate.__main__ import main
from fsdp_workflow.evaluate.per_checkpoint import evaluate_checkpoint
from fsdp_workflow.evaluate.perplexity import MAX_EVAL_SAMPLES
from fsdp_workflow.evaluate.run import RunNotReadable, open_run
from tests.conftest import EMA_RUN, EMA_STEPS
from tests.train.runner import launch_env, make_run_dir

pytestmark = pytest.mark.slow

STEPS, EVERY = 4, 2  # two of the shared run's checkpoints
RECORD_KEYS = {"step", "status", "job_id", "loss", "perplexity", "num_tokens", "ema_loss", "ema_perplexity", "seconds"}


@pytest.fixture
def run(ema_run: Path) -> Path:
    return ema_run


def _weights(run_dir: Path, step: int, root: str) -> dict[str, torch.Tensor]:
    """The full tensors under ``root.`` of ``step-N``, read with DCP in this process, root stripped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = str(RunDir.of(run_dir).step_dir(step))
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith(root + ".") and hasattr(v, "size")}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return {k[len(root) + 1:]: v for k, v in sd.items()}


def _reference_loss(run_dir: Path, step: int, root: str) -> tuple[float, int]:
    """Mean loss per trained held-out token of ``root``'s weights, and the token count, computed apart from evaluate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    layout = RunDir.of(run_dir)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(layout.hf_assets))
    missing, unexpected = model.load_state_dict(_weights(run_dir, step, root), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()  # evaluate measures in bf16
    held = open_cache(layout, pad_id=0).split("eval")  # padding carries no loss, and attends only to itself
    assert held is not None and 0 < held.num_samples <= MAX_EVAL_SAMPLES  # so every sample is measured
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(held.num_samples):
            s = held.sample(i)
            ids, labels, pos = (torch.from_numpy(a).unsqueeze(0) for a in (s.input_ids, s.labels, s.position_ids))
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            total += F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum").item()
            count += int((labels[0, 1:] != -100).sum())
    return total / count, count


def _evals(run_dir: Path) -> list[dict]:
    path = RunDir.of(run_dir).evals_file
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_cli_appends_the_held_out_loss_of_the_model_and_of_its_ema(run: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.evaluate", str(run), str(STEPS)],
                          env={**launch_env(run), "SLURM_JOB_ID": "4242"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert _evals(run)[-1] == printed  # the line it appended is the one it printed
    assert set(printed) == RECORD_KEYS and printed["status"] == "ok" and printed["step"] == STEPS
    assert printed["job_id"] == "4242" and printed["seconds"] > 0
    loss, tokens = _reference_loss(run, STEPS, "model")
    assert printed["num_tokens"] == tokens
    assert printed["loss"] == pytest.approx(loss, rel=1e-4)
    assert printed["perplexity"] == pytest.approx(math.exp(printed["loss"]))
    ema_loss, _ = _reference_loss(run, STEPS, "ema")
    assert printed["ema_loss"] == pytest.approx(ema_loss, rel=1e-4) and abs(printed["ema_loss"] - printed["loss"]) > 1e-4
    assert printed["ema_perplexity"] == pytest.approx(math.exp(printed["ema_loss"]))
    assert not RunDir.of(run).eval_model(STEPS).exists() and not RunDir.of(run).eval_model_ema(STEPS).exists()


def test_the_snapshot_is_read_and_removed_the_checkpoint_kept(run: Path) -> None:
    layout = RunDir.of(run)
    snapshot = layout.eval_snapshot(EVERY)
    shutil.copytree(layout.step_dir(EVERY), snapshot, copy_function=os.link)  # as post_checkpoint.sh
    record = evaluate_checkpoint(open_run(run), EVERY)
    assert record["status"] == "ok" and record["loss"] == pytest.approx(_reference_loss(run, EVERY, "model")[0], rel=1e-4)
    assert not snapshot.exists() and layout.step_dir(EVERY).is_dir()


def _holding(tmp_path: Path, steps: list[int], overrides: tuple[str, ...] = (),
             saved: Optional[list[int]] = None) -> Path:
    """A run directory whose checkpoints/ holds complete-looking ``step-N`` for ``steps`` (no weights).

    The smoke config saves every 10 steps to ``train.max_steps=30``. ``saved``: the steps its
    ``saves.jsonl`` records, as the trainer writes it; None leaves the run without that record
    (a run of an earlier version).
    """
    run_dir = make_run_dir(tmp_path / "run", list(overrides), prepare_data=False)
    for step in steps:
        RunDir.of(run_dir).step_dir(step).mkdir(parents=True)
        (RunDir.of(run_dir).step_dir(step) / ".metadata").write_bytes(b"")
    if saved is not None:
        RunDir.of(run_dir).saves.write_text("".join(json.dumps({"step": s}) + "\n" for s in saved))
    return run_dir


@pytest.mark.parametrize("saved", [[10, 20, 30], None], ids=["recorded", "older-run"])
def test_a_checkpoint_pruned_before_the_job_ran_is_skipped_naming_it(tmp_path: Path, saved) -> None:
    run_dir = _holding(tmp_path, [20, 30], saved=saved)  # keep_last=2 pruned step-10 when step-30 landed
    assert main([str(run_dir), "10"]) == 0
    [record] = _evals(run_dir)
    assert record["status"] == "skipped" and record["reason"] == f"{RunDir.of(run_dir).step_dir(10)} is gone " \
        "(pruned by keep_last before this job ran)" and "loss" not in record


def test_a_checkpoint_set_aside_as_damaged_is_skipped_naming_it(tmp_path: Path) -> None:
    run_dir = _holding(tmp_path, [4])
    (RunDir.of(run_dir).checkpoints / "step-6.corrupt-2").mkdir()  # the second set aside at step 6
    assert main([str(run_dir), "6"]) == 0
    [record] = _evals(run_dir)
    assert record["status"] == "skipped" and "set aside as damaged (step-6.corrupt)" in record["reason"]


def test_the_final_checkpoint_removed_after_its_consolidation_is_skipped(tmp_path: Path) -> None:
    run_dir = _holding(tmp_path, [], ("consolidate.remove_sharded=true",))
    assert main([str(run_dir), "30"]) == 2  # not consolidated yet: nothing explains the absence
    RunDir.of(run_dir).hf_model.mkdir()
    (RunDir.of(run_dir).hf_model / "verification.json").write_text("{}")
    assert main([str(run_dir), "30"]) == 0
    [record] = _evals(run_dir)
    assert record["status"] == "skipped" and "consolidate.remove_sharded=true" in record["reason"]


def test_a_step_the_run_never_saved_exits_2_listing_the_saved_steps_and_records_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41: ``evaluate RUN 7`` with saves every 10 appended a false "step-7 is gone (pruned ...)" record."""
    run_dir = _holding(tmp_path, [20, 30], saved=[10, 20, 30])
    for step in (7, 0, 99):  # between two saves, before the first, past the last
        assert main([str(run_dir), str(step)]) == 2
        err = capsys.readouterr().err
        assert f"{RunDir.of(run_dir).step_dir(step)}: step {step} was never saved: this run saved " \
            "step-10, step-20, step-30 (checkpoint.every_steps=10: a checkpoint every 10 steps" in err, err
        assert "pruned" not in err and f"python -m fsdp_workflow.evaluate {run_dir} 30" in err
    assert not RunDir.of(run_dir).evals_file.exists()  # nothing appended by any refused call
    # A step the trainer saved outside the interval (a preemption's save at 13) is a saved step.
    RunDir.of(run_dir).saves.write_text("".join(json.dumps({"step": s}) + "\n" for s in (10, 13, 20, 30)))
    assert main([str(run_dir), "13"]) == 0 and _evals(run_dir)[-1]["reason"].endswith("(pruned by keep_last "
                                                                                      "before this job ran)")


def test_a_run_without_the_saves_record_falls_back_to_the_save_interval(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _holding(tmp_path, [20, 30])  # written before saves.jsonl existed
    assert main([str(run_dir), "7"]) == 2
    err = capsys.readouterr().err
    assert "step 7 was never saved: this run saves by the rule checkpoint.every_steps=10" in err and \
        "train.max_steps=30" in err and "pruned" not in err, err
    assert main([str(run_dir), "99"]) == 2 and main([str(run_dir), "0"]) == 2
    assert not RunDir.of(run_dir).evals_file.exists()
    # the step of the checkpoint train_exit.json names (a preemption's save) can have been saved
    RunDir.of(run_dir).train_exit.write_text(json.dumps(
        {"exit_code": 75, "step": 13, "checkpoint": str(RunDir.of(run_dir).step_dir(13))}))
    assert main([str(run_dir), "13"]) == 0 and _evals(run_dir)[-1]["status"] == "skipped"


def test_the_trainer_records_every_step_it_saved(run: Path) -> None:
    """The shared run saved every step (keep_last=0): saves.jsonl lists each once, in order."""
    from fsdp_workflow.config.record import open_run as run_record

    saves = run_record(run).saves
    assert saves is not None and saves.steps == list(range(1, EMA_STEPS + 1)) and not saves.problems


def test_a_damaged_checkpoint_fails_with_exit_1_and_says_why(run: Path) -> None:
    layout = RunDir.of(run)
    bad = layout.step_dir(STEPS + 100)
    shutil.copytree(layout.step_dir(STEPS), bad)
    try:
        shard = sorted(bad.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:64])  # cut short: the metadata points past its end
        before = len(_evals(run))
        assert main([str(run), str(STEPS + 100)]) == 1
        [record] = _evals(run)[before:]
        assert record["status"] == "failed" and record["reason"].startswith("consolidation failed: ")
        assert shard.name in record["reason"]
        assert not layout.eval_model(STEPS + 100).exists() and not layout.eval_model_ema(STEPS + 100).exists()
    finally:
        shutil.rmtree(bad)


def test_a_run_without_held_out_data_is_skipped(run: Path, tmp_path: Path) -> None:
    other = make_run_dir(tmp_path / "no held out", [*EMA_RUN, "data.eval_fraction=0"])
    a, b = RunDir.of(run), RunDir.of(other)
    shutil.copytree(a.hf_assets, b.hf_assets)
    shutil.copytree(a.step_dir(STEPS), b.step_dir(STEPS))
    assert main([str(other), str(STEPS)]) == 0
    [record] = _evals(other)
    assert record["status"] == "skipped" and "data.eval_fraction" in record["reason"]


@pytest.mark.parametrize("argv, said", [(["RUN"], "required: step"), (["RUN", "x"], "'x' is not a step number"),
                                        (["RUN", "-1"], "'-1' is not a step number")])
def test_bad_arguments_exit_2_with_the_usage(argv: list[str], said: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(tmp_path) if a == "RUN" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: python -m fsdp_workflow.evaluate" in err and said in err
    assert list(tmp_path.iterdir()) == []


def test_a_directory_without_config_exits_2_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "2"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.yaml'}: not found" in err and "run_dir=RUN_DIR" in err
    assert list(tmp_path.iterdir()) == []  # no evals.jsonl


def test_an_edited_config_the_schema_refuses_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(RunNotReadable, match=r"config\.yaml: does not load as this version's config .*max_stepz"):
        open_run(tmp_path)


def test_paths_hang_off_the_directory_given(run: Path, tmp_path: Path) -> None:
    """The layout is built once, from RUN_DIR as given, with the config's log_dir / output_dir."""
    ev = open_run(run)
    assert ev.layout == RunDir.of(run, ev.cfg.cluster.log_dir, ev.cfg.consolidate.output_dir)
    moved = tmp_path / "moved"  # its config.yaml still records the old run_dir
    moved.mkdir()
    shutil.copy2(RunDir.of(run).config, moved)
    assert open_run(moved).layout.root == moved and open_run(moved).cfg.run_dir == str(run)
