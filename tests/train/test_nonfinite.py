"""A diverged run never ships: ``python -m fsdp_workflow`` with a learning rate that blows up (issue 24, item 1).

The real local route (planning, data preparation, 2 gloo ranks under torchrun,
consolidation enabled): the loss or the gradient norm becomes NaN/inf within a few
steps, the ranks stop at that step with exit 65, nothing from the bad state is saved,
and the consolidation never runs.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.exit_codes import EXIT_NONFINITE
from fsdp_workflow.core.rundir import REQUEUE_MARKER
from fsdp_workflow.train.loop import nonfinite
from tests.train.runner import _process_env, cli_argv, metrics_steps

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
