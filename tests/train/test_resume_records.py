"""No step is recorded twice after a resume (issue 24, item 3): metrics.jsonl, TensorBoard, ``status``'s curves.

A real local run (``python -m fsdp_workflow``, 2 gloo ranks) is killed with
SIGKILL (every process: no handler runs) after logging steps past its last
checkpoint; the same command resumes from that checkpoint and redoes them. Each
step must then be on record exactly once, with the redone run's values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_workflow.report.curves import read_series
from fsdp_workflow.train.metrics import keep_steps_up_to
from tests.train.runner import kill_tree, log_text, metrics_steps, start_cli, wait_for_step

RUN = ["cluster=local", "cluster.device=cpu", "cluster.processes_per_node=2", "train.seq_len=64",
       "train.max_steps=14", "checkpoint.every_steps=4", "train.log_every_steps=1", "consolidate.enabled=false",
       "train.report_to=[tensorboard]"]


def test_keep_steps_up_to_drops_later_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in (1, 2, 3, 4, 5)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # a kill in the middle of a write
    assert keep_steps_up_to(path, 3) == 3
    assert path.read_text() == "".join(f"{line}\n" for line in lines[:3])
    assert keep_steps_up_to(path, 3) == 0  # nothing to drop: left alone
    assert keep_steps_up_to(tmp_path / "missing.jsonl", 3) == 0
    assert keep_steps_up_to(path, 0) == 3 and path.read_text() == ""  # a fresh start forgets them all


@pytest.mark.slow
def test_steps_redone_after_a_kill_9_are_recorded_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_cli(run, RUN)
    try:
        wait_for_step(run, 6, proc)
    finally:
        kill_tree(proc)  # SIGKILL to the CLI, torchrun and every rank
    ckpts = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    before = metrics_steps(run)
    assert ckpts and max(before) > ckpts[-1], (ckpts, before)  # steps were logged past the checkpoint
    resumed_at = ckpts[-1]

    again = start_cli(run, RUN)
    try:
        again.wait(timeout=240)
    finally:
        if again.poll() is None:
            kill_tree(again)
    assert again.returncode == 0, log_text(run)[-4000:]
    assert f"at step {resumed_at}" in log_text(run)
    assert metrics_steps(run) == list(range(1, 15))  # each step exactly once, in order
    assert read_series(run / "metrics.jsonl").steps == list(range(1, 15))

    # TensorBoard (its own reader): each step once, the redone value where a step was redone.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "trackers" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in logged] == list(range(1, 15)), logged
    final = {json.loads(line)["step"]: json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()}
    assert all(v == pytest.approx(final[s], rel=1e-6) for s, v in logged)
