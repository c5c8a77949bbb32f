"""Make run directories and launch the trainer the way the planner does (for tests).

``make_run_dir`` composes ``conf/`` with overrides, writes the resolved
``config.yaml`` and ``launch.env``; ``launch`` runs
``torchrun --nproc_per_node N --standalone -m fsdp_workflow.train RUN_DIR`` with
launch.env's variables in the environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from fsdp_workflow.config.accelerate_env import accelerate_env, read_launch_env, write_launch_env
from fsdp_workflow.config.load import compose, to_yaml

# Small and quick: the tiny Llama, 64-token sequences.
FAST = ["train.seq_len=64", "train.micro_batch_size=2", "train.log_every_steps=5", "optimizer.warmup_steps=2"]


def make_run_dir(run_dir: Path, overrides: Sequence[str] = ()) -> Path:
    """Compose the config with ``overrides``, write ``config.yaml`` and ``launch.env`` into ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose([*FAST, *overrides, f"run_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    write_launch_env(accelerate_env(cfg), run_dir / "launch.env")
    return run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(run_dir: Path, nproc: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--nnodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "fsdp_workflow.train", str(run_dir),
    ]


def launch_env(run_dir: Path, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(read_launch_env(run_dir / "launch.env"))
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def launch(run_dir: Path, nproc: int = 2, extra_env: Optional[dict[str, str]] = None,
           timeout_s: float = 180) -> subprocess.CompletedProcess:
    """Run the trainer to completion; output is kept in ``run_dir/train.log``."""
    with open(run_dir / "train.log", "ab") as log:
        return subprocess.run(launch_cmd(run_dir, nproc), env=launch_env(run_dir, extra_env),
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)


def start(run_dir: Path, nproc: int = 2, extra_env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start the trainer in its own process group (so a test can signal or kill all of it)."""
    log = open(run_dir / "train.log", "ab")
    return subprocess.Popen(launch_cmd(run_dir, nproc), env=launch_env(run_dir, extra_env),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def log_text(run_dir: Path) -> str:
    return (run_dir / "train.log").read_text(errors="replace")


def losses(run_dir: Path) -> dict[int, float]:
    """``step -> loss`` from metrics.jsonl (the last line of a step wins)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out
