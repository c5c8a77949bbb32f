"""A run directory as the trainer leaves it mid-run: config.yaml, a metrics.jsonl of real-looking numbers, heartbeats."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Optional, Tuple

from fsdp_workflow.config.load import compose, to_yaml
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.rundir import RunDir

STEPS = 500  # logged so far
MAX_STEPS = 1000  # train.max_steps
SPIKE_STEP, SPIKE_LOSS = 300, 9.0  # one bad batch: the curve must still show it after downsampling
EVAL_EVERY = 100
PACE_S = 0.5  # wall-clock seconds per step
REQUEUE_GAP_S = 120.0  # the requeue before step 251: one long gap the pace must ignore
T0 = 1_795_000_000.0


def smooth(step: int) -> float:
    return 2.0 + 3.0 * math.exp(-step / 80)


def loss_at(step: int) -> float:
    return SPIKE_LOSS if step == SPIKE_STEP else smooth(step)


def eval_at(step: int) -> float:
    return smooth(step) + 0.1


@functools.lru_cache(maxsize=None)
def _composed(overrides: Tuple[str, ...]) -> WorkflowConfig:
    return compose(["+experiment=smoke", *overrides])


def config_yaml(root: Path, *overrides: str) -> str:
    """A full ``config.yaml`` as the planner writes it: the smoke experiment with ``overrides``, run_dir ``root``.

    The run record reads the config through the schema, as every job does, so a fixture's
    config is a real one (composed once per set of overrides).
    """
    return to_yaml(dataclasses.replace(_composed(tuple(overrides)), run_dir=str(root)))


def write_heartbeat(run: RunDir, rank: int, pid: int, age_s: float = 0.0, host: Optional[str] = None,
                    interval_s: float = 5.0) -> None:
    """A heartbeat as the trainer's writes it (train/heartbeat.py), last beaten ``age_s`` ago."""
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    run.heartbeat(rank).write_text(json.dumps({
        "rank": rank, "host": host or socket.gethostname(), "pid": pid, "phase": "step", "step": 1, "beats": 3,
        "time": time.time() - age_s, "interval_s": interval_s}))


def write_run(root: Path, steps: int = STEPS, alive: bool = True) -> RunDir:
    """config.yaml (train.max_steps) and metrics.jsonl with ``steps`` steps, a torn line and a redone step.

    ``alive``: rank 0's heartbeat names this (live) test process, beating every hour, so the run is
    running; otherwise there is no heartbeat at all.
    """
    run = RunDir(root)
    root.mkdir(parents=True)
    run.config.write_text(config_yaml(run.root, "name=fixture", f"train.max_steps={MAX_STEPS}"))
    lines, t = [], T0
    for step in range(1, steps + 1):
        t += PACE_S + (REQUEUE_GAP_S if step == 251 else 0.0)
        rec = {"time": round(t, 3), "step": step, "loss": loss_at(step), "lr": 1e-4, "grad_norm": 1.0,
               "tokens_per_s": 8000.0 + step, "trained_tokens": 4000, "mfu": 0.30 + step / 1e5,
               "peak_tflops": 989.0, "step_time_s": 0.45, "samples_consumed": 8 * step}
        if step % EVAL_EVERY == 0:
            rec["eval_loss"] = eval_at(step)
        if step == 250:  # the crash tore a line, then the resume redid step 250
            lines.append(json.dumps({**rec, "loss": 99.0}))
            lines.append('{"step": 251, "lo')
        lines.append(json.dumps(rec))
    run.metrics.write_text("\n".join(lines) + "\n")
    if alive:
        write_heartbeat(run, 0, os.getpid(), interval_s=3600.0)
    return run
