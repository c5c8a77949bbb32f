"""Make run directories and launch the trainer the way the planner does (for tests).

``make_run_dir`` composes ``conf/`` with overrides, writes the resolved
``config.yaml`` and ``launch.env`` and prepares the data (the token cache and
the run's data pointer, as the chain's prepare job does); ``launch`` runs
``python -m fsdp_workflow.train.node --nproc_per_node N -m fsdp_workflow.train RUN_DIR``
(torchrun's arguments and agent, the ranks forked after one import: what the planner
renders for a CPU run) with launch.env's variables in the environment, and no other flag.

Signal tests never use that command: they run what users and Slurm run, the
generated ``train_node.sh`` (``start_node_script``, after ``write_scripts``) or
``python -m fsdp_workflow`` itself (``start_cli``), with nothing added.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from fsdp_workflow.backends.local import free_port  # the tests' rendezvous ports, picked as the launcher picks its own
from fsdp_workflow.config.accelerate_env import accelerate_env, read_launch_env
from fsdp_workflow.config.load import compose, to_yaml
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.plan.render import render_launch_env

# Small and quick: the tiny Llama, 64-token sequences.
FAST = ["+experiment=smoke", "train.seq_len=64", "train.micro_batch_size=2", "train.log_every_steps=5", "optimizer.warmup_steps=2"]


def make_run_dir(run_dir: Path, overrides: Sequence[str] = (), prepare_data: bool = True) -> Path:
    """Compose the config with ``overrides``, write ``config.yaml`` and ``launch.env`` into ``run_dir``.

    Args:
        run_dir: the run directory (created).
        overrides: Hydra overrides on top of :data:`FAST`.
        prepare_data: run the prepare step in this process (one worker), as the
            chain does before training; False leaves the run without data.
    """
    from fsdp_workflow.data.prepare import prepare

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_config(run_dir, overrides)
    if prepare_data:
        prepare(cfg, num_workers=1, progress=False)
    return run_dir


def write_config(run_dir: Path, overrides: Sequence[str] = ()) -> WorkflowConfig:
    """(Re)write ``run_dir``'s ``config.yaml`` and ``launch.env`` from :data:`FAST` and ``overrides``.

    A copied run given another config this way resumes its checkpoints under the new one.
    """
    cfg = compose([*FAST, *overrides, f"run_dir={run_dir}"])
    layout = RunDir.of(run_dir)
    layout.config.write_text(to_yaml(cfg))
    layout.launch_env.write_text(render_launch_env(accelerate_env(cfg)))
    return cfg


def launch_cmd(run_dir: Path, nproc: int = 2) -> list[str]:
    # What the planner renders for a CPU run (cluster.rank_start=auto): torchrun's arguments, to
    # the node launcher that forks the ranks after one import (fsdp_workflow/train/node.py).
    return [
        sys.executable, "-m", "fsdp_workflow.train.node",
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


def log_file(run_dir: Path) -> Path:
    """The test's capture of a run's output: beside the run directory, never inside it.

    The CLI refuses a non-empty ``run_dir`` that holds no run of this tool, so a log
    written into a new run directory before planning would make the run refuse itself.
    """
    return run_dir.parent / f"{run_dir.name}.train.log"


def launch(run_dir: Path, nproc: int = 2, extra_env: Optional[dict[str, str]] = None,
           timeout_s: float = 180) -> subprocess.CompletedProcess:
    """Run the trainer to completion; output is kept in :func:`log_file`."""
    with open(log_file(run_dir), "ab") as log:
        return subprocess.run(launch_cmd(run_dir, nproc), env=launch_env(run_dir, extra_env),
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)


def launched(run_dir: Path, nproc: int = 2, timeout_s: float = 180) -> Path:
    """:func:`launch` that must succeed (the test fails with the run's log); returns ``run_dir``."""
    proc = launch(run_dir, nproc=nproc, timeout_s=timeout_s)
    assert proc.returncode == 0, log_text(run_dir)[-6000:]
    return run_dir


def start(run_dir: Path, nproc: int = 2, extra_env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start the trainer in the background (torchrun gives each rank its own session)."""
    with open(log_file(run_dir), "ab") as log:
        return subprocess.Popen(launch_cmd(run_dir, nproc), env=launch_env(run_dir, extra_env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _process_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """This interpreter's ``python``/``torchrun`` first on PATH; one thread per rank (2 shared cores)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def write_scripts(run_dir: Path, cfg: Optional[WorkflowConfig] = None) -> Path:
    """(Re)write ``run_dir``'s config and job scripts, as the CLI would, for ``run_dir``.

    ``cfg``: the config to write (default: the one ``config.yaml`` holds).
    """
    from fsdp_workflow.config.load import load_run_config
    from fsdp_workflow.backends.registry import backend_for
    from fsdp_workflow.plan.run_dir import write_run_dir

    cfg = load_run_config(run_dir / "config.yaml") if cfg is None else cfg
    cfg.run_dir = str(run_dir)  # a copied run dir's config still names its source
    write_run_dir(cfg, backend_for(cfg))
    return run_dir


def start_node_script(run_dir: Path, extra_env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """``bash RUN_DIR/train_node.sh`` as ``srun`` starts it on node 0; the script execs torchrun."""
    env = _process_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(extra_env or {})})
    env.pop("SLURM_NODEID", None)
    with open(log_file(run_dir), "ab") as log:
        return subprocess.Popen(["bash", str(run_dir / "train_node.sh")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def cli_argv(run_dir: Path, overrides: Sequence[str] = ()) -> list[str]:
    """``python -m fsdp_workflow +experiment=smoke run_dir=RUN_DIR OVERRIDES`` with this interpreter."""
    return [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", f"run_dir={run_dir}", *overrides]


def start_cli(run_dir: Path, overrides: Sequence[str] = (), extra_env: Optional[dict[str, str]] = None,
              stderr_to: Optional[Path] = None) -> subprocess.Popen:
    """``python -m fsdp_workflow run_dir=RUN_DIR OVERRIDES``: the local run, exactly as a user starts it.

    Output goes to :func:`log_file` (beside the run directory); with
    ``stderr_to``, stderr goes there instead (what a user's terminal would show).
    The CLI leads a process group of its own: ``os.killpg(proc.pid, SIGINT)`` is a Ctrl-C.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log_file(run_dir), "ab") as log:
        err = open(stderr_to, "ab") if stderr_to is not None else None
        try:
            return subprocess.Popen(cli_argv(run_dir, overrides), env=_process_env(extra_env), cwd=run_dir.parent,
                                    stdout=log, stderr=err if err is not None else subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            if err is not None:
                err.close()


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(d.name))
    return out


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started, by reading /proc."""
    return sorted(_children().get(pid, []))


def cmdline(pid: int) -> Optional[str]:
    """``pid``'s command line, words joined by spaces; None once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def rank_pids(torchrun_pid: int) -> list[int]:
    """The worker processes a node launcher started: torchrun's children, or, under
    ``python -m fsdp_workflow.train.node`` (a CPU run's default), the children of the
    forkserver they were forked from (not the forkserver, nor multiprocessing's resource tracker).
    The forkserver is the launcher's own fork (the same command line) or, on a Python whose
    forkserver the launcher does not fork itself, multiprocessing's spawned one."""
    out: list[int] = []
    launcher = cmdline(torchrun_pid)
    for pid in child_pids(torchrun_pid):
        cmd = cmdline(pid)
        if cmd is None:
            continue
        if "multiprocessing.forkserver" in cmd or (cmd == launcher and "fsdp_workflow.train.node" in cmd):
            out.extend(child_pids(pid))
        elif "multiprocessing.resource_tracker" not in cmd:
            out.append(pid)
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun and the ranks, which sit in sessions of their own)."""
    children, out, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def alive(pid: int) -> bool:
    """Running (not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything below it (test cleanup; the ranks are not in its group)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def metrics_steps(run_dir: Path) -> list[int]:
    """The ``step`` of every line of metrics.jsonl, in file order (a torn last line is skipped)."""
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return out


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Block until metrics.jsonl reports ``step`` (fails if the run ends or time runs out)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s >= step for s in metrics_steps(run_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer ended (rc {proc.returncode}) before step {step}:\n{log_text(run_dir)}")
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout_s} s:\n{log_text(run_dir)}")


def log_text(run_dir: Path) -> str:
    return (log_file(run_dir)).read_text(errors="replace")


def losses(run_dir: Path) -> dict[int, float]:
    """``step -> loss`` from metrics.jsonl (the last line of a step wins)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def cosine_lr(lr: float, warmup: int, max_steps: int, done: int, floor: float = 0.0) -> float:
    """The lr of the step after ``done`` completed ones: docs/training.md's table, written out again."""
    if done < warmup:
        return lr * done / warmup
    progress = (done - warmup) / (max_steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
