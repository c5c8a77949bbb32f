"""Resume rules on real 2-rank gloo runs, and the tool's advice followed as it is printed (issue 36, item 1).

* a copy of the session's straight run resumed from step-10 under a new lr, max_steps,
  betas and weight decay: the first resumed step already runs at the new schedule, and
  the checkpoint it writes holds the new hyperparameters beside the carried-on state;
* ``python -m fsdp_workflow`` on a finished run says "To train further: the same command
  with a larger train.max_steps and checkpoint.resume=...": that command trains on at the
  longer schedule (before, step 5 of a run extended 4 -> 6 ran at lr 0); another
  ``optimizer.name`` on that resume is refused with exit 2 naming the key.

The advice after a divergence is followed in ``test_nonfinite.py``, after a preemption
and a Ctrl-C in ``test_preemption.py``. Expected learning rates come from
:func:`tests.train.runner.cosine_lr` (docs/training.md's formula), never from
the trainer's own schedule code.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp_workflow.config.load import load_run_config, to_yaml
from fsdp_workflow.core.exit_codes import EXIT_OK, EXIT_USAGE
from tests.train.conftest import copy_run
from tests.train.runner import _process_env, cli_argv, cosine_lr, launched, losses

pytestmark = pytest.mark.slow


def records(run: Path) -> dict[int, dict]:
    """``step -> record`` from metrics.jsonl (the last line of a step wins)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def checkpoint_dict(step_dir: Path, tmp: Path) -> dict:
    """Everything a DCP checkpoint holds, non-tensor items included, as one nested dict."""
    import torch

    out = tmp / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=True)


def test_a_new_schedule_and_hyperparameters_apply_from_the_first_resumed_step(straight_run: Path,
                                                                             tmp_path: Path) -> None:
    """straight: lr 3e-3, warmup 2, 20 steps. Resumed from its step-10 with lr 1e-4, max_steps 14,
    betas (0.8, 0.9), weight decay 0.05: steps 11-14 log the new schedule's lr (computed here), step 11
    is the straight run's step 11 exactly (weights, data position and RNG from the checkpoint, the lr
    acts only on the update), step 12 is not, and step-14 records the new values beside step 14's moments."""
    run = copy_run(straight_run, tmp_path / "run", checkpoints=(10,))
    cfg = load_run_config(run / "config.yaml")
    cfg.run_dir = str(run)
    cfg.optimizer.lr, cfg.train.max_steps = 1e-4, 14
    cfg.optimizer.betas, cfg.optimizer.weight_decay = [0.8, 0.9], 0.05
    cfg.checkpoint.resume = str(run / "checkpoints" / "step-10")
    (run / "config.yaml").write_text(to_yaml(cfg))
    launched(run)

    got, ref = records(run), records(straight_run)
    assert sorted(got) == list(range(11, 15))
    warmup = cfg.optimizer.warmup_steps
    assert [got[s]["lr"] for s in range(11, 15)] == pytest.approx(
        [cosine_lr(1e-4, warmup, 14, s - 1) for s in range(11, 15)], rel=1e-12)
    assert ref[11]["lr"] == pytest.approx(cosine_lr(3e-3, warmup, 20, 10), rel=1e-12)  # what it ran at before
    assert (got[11]["loss"], got[11]["grad_norm"], got[11]["samples_consumed"]) == \
        (ref[11]["loss"], ref[11]["grad_norm"], ref[11]["samples_consumed"])
    assert got[12]["loss"] != ref[12]["loss"]

    saved = checkpoint_dict(run / "checkpoints" / "step-14", tmp_path)
    decay, no_decay = saved["optimizer"]["param_groups"]
    assert (decay["initial_lr"], tuple(decay["betas"]), decay["weight_decay"]) == (1e-4, (0.8, 0.9), 0.05)
    assert (no_decay["initial_lr"], tuple(no_decay["betas"]), no_decay["weight_decay"]) == (1e-4, (0.8, 0.9), 0.0)
    assert decay["lr"] == pytest.approx(cosine_lr(1e-4, warmup, 14, 14), abs=1e-18)
    assert saved["scheduler"]["base_lrs"] == [1e-4, 1e-4] and saved["scheduler"]["last_epoch"] == 14
    steps = {float(v["step"]) for v in saved["optimizer"]["state"].values()}
    assert steps == {14.0}, steps  # AdamW's step counts carried on from the checkpoint's 10


def _cli(run: Path, overrides: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(run, overrides), env=_process_env(), cwd=run.parent, capture_output=True,
                          text=True, timeout=timeout_s)


SHORT = ["cluster=local", "cluster.device=cpu", "cluster.processes_per_node=2", "train.seq_len=64",
         "train.max_steps=4", "checkpoint.every_steps=4", "consolidate.enabled=false", "optimizer.lr=1e-2"]


def test_a_finished_run_trains_further_at_the_longer_schedule_as_the_complete_message_says(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _cli(run, SHORT)
    assert first.returncode == EXIT_OK, first.stderr[-4000:]

    again = _cli(run, SHORT)
    assert again.returncode == EXIT_OK, again.stderr[-4000:]
    (line,) = [ln for ln in again.stdout.splitlines() if "this run is complete" in ln]
    how = line.split("To train further: the same command with a larger train.max_steps and ", 1)[1]
    (resume,) = [w for w in shlex.split(how.rstrip(".")) if w.startswith("checkpoint.resume=")]
    assert resume == f"checkpoint.resume={run / 'checkpoints' / 'step-4'}", line

    # Another optimizer on that resume: refused before anything loads, naming the key.
    sgd = _cli(run, [*SHORT, "train.max_steps=6", resume, "optimizer=sgd"])
    out = sgd.stdout + sgd.stderr
    assert sgd.returncode == EXIT_USAGE, out[-4000:]
    assert "optimizer.name=sgd: the checkpoint holds optimizer.name=adamw's state" in out, out[-4000:]
    assert "Fix: optimizer.name=adamw" in out and "Traceback" not in out, out[-4000:]
    assert sorted(losses(run)) == [1, 2, 3, 4]
    # Recorded as every other exit is (rank 0, train_exit.json), so status says why rather than "finished".
    record = json.loads((run / "train_exit.json").read_text())
    assert record["exit_code"] == EXIT_USAGE, record
    assert record["reason"].startswith("optimizer.name=sgd: the checkpoint holds optimizer.name=adamw's"), record
    status = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run)], env=_process_env(),
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr[-4000:]
    (said,) = [ln for ln in status.stdout.splitlines() if ln.startswith("trainer exit:")]
    assert said.startswith("trainer exit: 2 (refused: bad config or arguments): optimizer.name=sgd: the checkpoint "
                           "holds optimizer.name=adamw's state"), said

    longer = _cli(run, [*SHORT, "train.max_steps=6", resume])
    assert longer.returncode == EXIT_OK, longer.stderr[-4000:]
    got = records(run)
    assert sorted(got) == list(range(1, 7))
    warmup = load_run_config(run / "config.yaml").optimizer.warmup_steps  # the smoke experiment's 3
    assert [got[s]["lr"] for s in (5, 6)] == pytest.approx([cosine_lr(1e-2, warmup, 6, s - 1) for s in (5, 6)],
                                                           rel=1e-12)
    assert got[5]["lr"] > 1e-3  # not the 4-step schedule's final 0
