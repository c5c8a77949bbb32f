"""A diverged run never ships: ``python -m fsdp_workflow`` with a learning rate that blows up (issue 24, item 1).

The real local route (planning, data preparation, 2 gloo ranks under torchrun,
consolidation enabled): the loss or the gradient norm becomes NaN/inf within a few
steps, the ranks stop at that step with exit 65, nothing from the bad state is saved,
and the consolidation never runs. The advice it prints, followed, trains to the end.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
from pathlib import Path

import pytest

from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.exit_codes import EXIT_NONFINITE
from fsdp_workflow.core.rundir import REQUEUE_MARKER
from fsdp_workflow.train.loop import nonfinite
from tests.train.runner import _process_env, cli_argv, cosine_lr, metrics_steps

DIVERGES = ["cluster=local", "cluster.device=cpu", "cluster.processes_per_node=2", "train.seq_len=64",
            "optimizer.lr=1e6", "train.max_steps=30", "checkpoint.every_steps=1",
            "checkpoint.keep_last=0", "consolidate.enabled=true"]


@pytest.mark.parametrize("record,bad", [
    ({"loss": 2.0, "grad_norm": 1.0}, ""),
    ({"loss": 2.0, "grad_norm": None}, ""),  # a strategy that does not measure the norm
    ({"loss": math.nan, "grad_norm": 1.0}, "loss"),
    ({"loss": 2.0, "grad_norm": math.inf}, "grad norm"),
    ({"loss": -math.inf, "grad_norm": math.nan}, "loss"),
])
def test_nonfinite_names_the_bad_value(record: dict, bad: str) -> None:
    assert nonfinite(record) == bad


@pytest.mark.slow
def test_a_diverging_local_run_exits_65_keeps_the_last_good_checkpoint_and_ships_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = subprocess.run(cli_argv(run, DIVERGES), env=_process_env(), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    err = res.stderr
    assert res.returncode == EXIT_NONFINITE, err[-4000:]
    rec = json.loads((run / "train_exit.json").read_text())
    step = rec["step"]
    assert rec["exit_code"] == EXIT_NONFINITE and 1 <= step < 30, rec
    which = "loss" if "the loss became" in rec["reason"] else "grad norm"
    assert f"the {which} became" in rec["reason"] and f"at step {step}" in rec["reason"], rec
    # The user's terminal: the rank's reason and the step, one launcher line, no torchrun traceback.
    assert f"became nan at step {step}" in err or f"became inf at step {step}" in err, err[-4000:]
    assert f"exited with code {EXIT_NONFINITE}" in err and "consolidation skipped" in err, err[-4000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-4000:]
    # Nothing saved from the bad step: checkpoints (every step) stop just before it, each complete.
    names = sorted((p.name for p in (run / "checkpoints").iterdir()), key=lambda n: int(n.split("-")[1]))
    assert names == [f"step-{s}" for s in range(1, step)], names
    assert all(checkpoint_problem(run / "checkpoints" / n) is None for n in names)
    assert rec["checkpoint"] == (str(run / "checkpoints" / f"step-{step - 1}") if step > 1 else None), rec
    assert not (run / REQUEUE_MARKER).exists()
    assert not (run / "hf_model").exists() and not (run / "hf_model_ema").exists()
    assert metrics_steps(run) == list(range(1, step + 1))  # the bad step is on record, nothing after it

    # The advice, followed as printed: a lower optimizer.lr and the checkpoint.resume it names, the
    # newest checkpoint before the one holding the weights that gave the NaN. The run trains to its
    # end, finite, every resumed step at the lowered schedule (issue 36, item 1).
    reason = rec["reason"]
    assert "Lower optimizer.lr, then resume from it with checkpoint.resume=" in reason, reason
    (resume,) = [w for w in shlex.split(reason.split("resume from it with ", 1)[1].split(":", 1)[0])
                 if w.startswith("checkpoint.resume=")]
    good = int(resume.rsplit("step-", 1)[1])
    assert good == step - 2 and f"step-{step - 1} holds the weights that gave it" in reason, reason
    again = subprocess.run(cli_argv(run, [*DIVERGES, "optimizer.lr=1e-3", resume]), env=_process_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    got = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        got[json.loads(line)["step"]] = json.loads(line)
    assert sorted(got) == list(range(1, 31)) and all(math.isfinite(got[s]["loss"]) for s in got)
    assert [got[s]["lr"] for s in range(good + 1, 31)] == pytest.approx(
        [cosine_lr(1e-3, 3, 30, s - 1) for s in range(good + 1, 31)], rel=1e-12)  # the smoke warmup: 3
    assert (run / "hf_model" / "config.json").is_file()  # consolidated: the run ships
