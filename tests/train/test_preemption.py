"""Preemption through the commands that really run: ``python -m fsdp_workflow`` and ``train_node.sh``.

A signal sent to the CLI goes to torchrun's process group only; the ranks sit in
sessions of their own and see it only because the generated ``train_node.sh``
makes torchrun forward it. Nothing here adds a torchrun flag.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import Tracker
from fsdp_workflow.core.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_REQUEUE
from fsdp_workflow.core.rundir import DCP_METADATA, REQUEUE_MARKER
from fsdp_workflow.report.curves import read_series
from fsdp_workflow.train.fault_hooks import SAVE_DELAY_ENV
from tests.train.conftest import copy_run
from tests.train.runner import (
    alive, child_pids, cosine_lr, descendants, kill_tree, log_text, losses, metrics_steps, rank_pids, start_cli,
    start_node_script, wait_for_step, write_scripts,
)

pytestmark = pytest.mark.slow

# The smoke run (cluster=local, cpu, 2 processes), too long to end on its own while the test waits.
LONG_RUN = [
    "cluster=local", "cluster.device=cpu", "cluster.processes_per_node=2",
    "train.max_steps=100000", "checkpoint.every_steps=0", "train.seq_len=64", "train.log_every_steps=5",
    "strategy.activation_checkpointing=full", "consolidate.enabled=false",
]
STOP_WAIT_S = 60  # checkpointing takes a few seconds; without forwarding the run never stops


def _signal_cli_and_wait(run: Path, sig: signal.Signals, extra: tuple[str, ...] = ()) -> tuple[int, list[int]]:
    """Start the CLI, signal only its pid once a step is logged; return its exit code and the rank pids."""
    proc = start_cli(run, [*LONG_RUN, *extra])
    try:
        wait_for_step(run, 1, proc)
        (launcher,) = child_pids(proc.pid)  # bash train_node.sh, exec'd into torchrun
        ranks = rank_pids(launcher)
        assert len(ranks) == 2, (ranks, log_text(run))
        os.kill(proc.pid, sig)  # the CLI only: what `kill`, a supervisor or `timeout` does
        proc.wait(timeout=STOP_WAIT_S)
    except BaseException:
        kill_tree(proc)
        raise
    return proc.returncode, ranks


def _assert_stopped_with_checkpoint(run: Path, rc: int, ranks: list[int], sig: signal.Signals,
                                    log: str | None = None, earlier: tuple[str, ...] = ()) -> int:
    """Exit 75, no rank left, the record, the requeue marker and a complete step-N checkpoint.

    ``earlier``: the checkpoints of the run's earlier legs, kept beside the new one.
    """
    log = log_text(run) if log is None else log
    assert rc == EXIT_REQUEUE, log
    assert not [p for p in ranks if alive(p)], "ranks outlived the CLI"
    info = json.loads((run / "train_exit.json").read_text())
    assert info["exit_code"] == EXIT_REQUEUE and sig.name in info["reason"], info
    step = info["step"]
    assert 1 <= step < 100000 and max(losses(run)) == step
    assert (run / REQUEUE_MARKER).read_text() == f"step {step}\n"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted([*earlier, f"step-{step}"])
    md = FileSystemReader(str(run / "checkpoints" / f"step-{step}")).read_metadata()  # complete: has .metadata
    assert "model.model.layers.0.mlp.up_proj.weight" in md.state_dict_metadata  # no checkpoint-wrapper names
    assert not any("_checkpoint_wrapped_module" in k for k in md.state_dict_metadata)
    assert f"rerun the same command with checkpoint.resume=auto run_dir={run} to continue" in log
    return step


# The exec'd start (torchrun -m: what a CUDA run gets by default) for this test; the others
# run the preloaded one (cluster.rank_start=auto on CPU). Each path is signalled through the CLI.
EXEC_START = ("cluster.rank_start=exec",)


def test_sigterm_to_the_cli_checkpoints_exits_75_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rc, ranks = _signal_cli_and_wait(run, signal.SIGTERM, EXEC_START)
    assert " -m torch.distributed.run " in (run / "train_node.sh").read_text() or \
        "exec torchrun " in (run / "train_node.sh").read_text()
    step = _assert_stopped_with_checkpoint(run, rc, ranks, signal.SIGTERM)

    # Resume with an end in sight: a changed config (max_steps) must name the checkpoint
    # explicitly (a run_dir is never reused by accident); finish, and leave no stale marker.
    ckpt = run / "checkpoints" / f"step-{step}"
    proc = start_cli(run, [*LONG_RUN, *EXEC_START, f"checkpoint.resume={ckpt}", f"train.max_steps={step + 2}"])
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == EXIT_OK, log_text(run)
    assert f"resumed from {run / 'checkpoints' / f'step-{step}'}" in log_text(run)
    assert not (run / REQUEUE_MARKER).exists()
    # The steps before the signal ran at the 100000-step schedule; the two after it at the
    # (step + 2)-step one from the first (issue 36, item 1): the smoke experiment's lr 3e-3, warmup 3.
    lrs = _lrs(run)
    assert sorted(lrs) == list(range(1, step + 3))
    assert [lrs[s] for s in range(1, step + 1)] == pytest.approx(
        [cosine_lr(3e-3, 3, 100000, s - 1) for s in range(1, step + 1)], rel=1e-12)
    assert [lrs[s] for s in (step + 1, step + 2)] == pytest.approx(
        [cosine_lr(3e-3, 3, step + 2, s - 1) for s in (step + 1, step + 2)], rel=1e-12)


def _lrs(run: Path) -> dict[int, float]:
    """``step -> lr`` from metrics.jsonl (the last line of a step wins)."""
    return {json.loads(line)["step"]: json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()}


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model, optimizer state), loaded in this one process."""
    from fsdp_workflow.train.safe_load import SafeFileSystemReader, SafeLoadPlanner

    md = SafeFileSystemReader(str(step_dir)).read_metadata()
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(step_dir)), planner=SafeLoadPlanner(), no_dist=True)
    return state


def test_kill_9_during_save_keeps_previous_checkpoint(straight_run: Path, tmp_path: Path) -> None:
    """Resume from step-10, hang the step-20 save before .metadata, kill -9 everything, resume again.

    The straight run saves asynchronously (checkpoint.async_save=true), so the kill lands in
    the middle of a background save. Before the resume, two corrupt checkpoints newer than
    step-10 are planted (a garbled .metadata, a truncated shard): the run sets them aside,
    resumes from step-10 and must end bit-identical to the straight one.
    Steps 11-20 were logged before the kill and are redone after it: metrics.jsonl, status's
    curves and TensorBoard (``train.report_to=[tensorboard]`` on this copy) must hold each
    once, with the redone values (issue 24, item 3).
    """
    run = copy_run(straight_run, tmp_path / "killed", checkpoints=(10,))
    cfg = load_run_config(run / "config.yaml")
    cfg.train.report_to = [Tracker.tensorboard]  # trackers only log: the losses stay the straight run's
    (run / "config.yaml").unlink()  # planned afresh with it (the run-dir rule refuses a changed config)
    run = write_scripts(run, cfg)
    ckpts = run / "checkpoints"
    before = {p.name: p.read_bytes() for p in (ckpts / "step-10").iterdir()}
    proc = start_node_script(run, extra_env={SAVE_DELAY_ENV: "120"})  # bash execs torchrun: proc.pid is torchrun
    try:
        wait_for_step(run, 20, proc)
        deadline = time.monotonic() + 60
        while not (ckpts / "step-20.tmp" / "__1_0.distcp").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        for pid in [*rank_pids(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step-10", "step-20.tmp"], names
    assert not (ckpts / "step-20.tmp" / ".metadata").exists()
    assert {p.name: p.read_bytes() for p in (ckpts / "step-10").iterdir()} == before
    assert metrics_steps(run) == list(range(11, 21))  # logged past the last checkpoint, then killed
    assert _tensorboard_loss(run)[-1][0] > 10  # TensorBoard had them too: the redo below must replace them

    # Worse still, two newer checkpoints look whole by name but are not: step-15's .metadata
    # is garbled, step-17 has a truncated shard. Both are set aside, never deleted.
    for step in (15, 17):
        shutil.copytree(ckpts / "step-10", ckpts / f"step-{step}")
    meta = ckpts / "step-15" / DCP_METADATA
    meta.write_bytes(meta.read_bytes()[:200] + bytes(64) + meta.read_bytes()[264:])
    shard = ckpts / "step-17" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-4096])
    kept = {n: sorted((p.name, p.stat().st_size) for p in (ckpts / n).iterdir()) for n in ("step-15", "step-17")}

    proc2 = start_node_script(run)
    try:
        proc2.wait(timeout=180)
    finally:
        if proc2.poll() is None:
            kill_tree(proc2)
    log = log_text(run)
    assert proc2.returncode == 0, log
    assert f"WARNING [rank 0/{socket.gethostname()}] fsdp_workflow.train.checkpoint: skipping checkpoint " \
           f"{ckpts / 'step-17'}: shard {shard} is truncated" in log, log
    assert f"skipping checkpoint {ckpts / 'step-15'}: {meta} cannot be parsed" in log
    assert f"resumed from {ckpts / 'step-10'} at step 10" in log
    assert {n: sorted((p.name, p.stat().st_size) for p in (ckpts / f"{n}.corrupt").iterdir())
            for n in ("step-15", "step-17")} == kept
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-10", "step-15.corrupt", "step-17.corrupt", "step-20"]
    ref, got = losses(straight_run), losses(run)  # last line of a step wins
    assert [got[s] for s in range(11, 21)] == [ref[s] for s in range(11, 21)]
    want, have = _tensors(straight_run / "checkpoints" / "step-20"), _tensors(ckpts / "step-20")
    assert sorted(want) == sorted(have) and any(k.startswith("optimizer.") for k in want)
    assert [k for k in want if not torch.equal(want[k], have[k])] == []  # bit-identical, optimizer state included

    # Each redone step on record once: metrics.jsonl, status's curves, TensorBoard (its own reader).
    assert metrics_steps(run) == list(range(11, 21))
    assert read_series(run / "metrics.jsonl").steps == list(range(11, 21))
    logged = _tensorboard_loss(run)
    assert [s for s, _ in logged] == list(range(11, 21)), logged
    assert all(v == pytest.approx(got[s], rel=1e-6) for s, v in logged)


def _tensorboard_loss(run: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` as TensorBoard's own reader shows the run's events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "trackers" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


# ---------------------------------------------------------------- Ctrl-C (issue 24, item 3)
def _ctrl_c(proc) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


def test_ctrl_c_checkpoints_at_the_step_exits_75_and_the_printed_command_resumes(tmp_path: Path) -> None:
    """Ctrl-C at step 2: exit 75, no traceback, a checkpoint and a printed command; that command,
    pasted into bash, resumes, and SIGUSR2 to its CLI alone checkpoints and exits 75 again."""
    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    proc = start_cli(run, LONG_RUN, stderr_to=err)
    try:
        wait_for_step(run, 2, proc)
        _ctrl_c(proc)
        proc.wait(timeout=STOP_WAIT_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = err.read_text()
    assert proc.returncode == EXIT_REQUEUE, text[-4000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "ChildFailedError" not in text, text
    info = json.loads((run / "train_exit.json").read_text())
    step = info["step"]
    assert info["exit_code"] == EXIT_REQUEUE and "SIGINT" in info["reason"], info
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{step}"]
    assert max(metrics_steps(run)) == step
    # The printed command, pasted into bash as is, resumes from that checkpoint.
    (cmd,) = [line.split("resume with: ", 1)[1] for line in text.splitlines() if "resume with: " in line]
    assert f"run_dir={run}" in cmd and "checkpoint.resume=auto" in cmd, cmd
    with open(run / "resumed.log", "ab") as out:
        again = subprocess.Popen(["bash", "-c", cmd], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    # The resumed leg is stopped as a batch system or `kill -USR2` stops a job: SIGUSR2 to the CLI alone.
    try:
        deadline = time.monotonic() + 120
        while max(metrics_steps(run)) <= step + 1 and again.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        cli = _cli_pid(again)
        (launcher,) = child_pids(cli)
        ranks = rank_pids(launcher)
        assert len(ranks) == 2, ranks
        os.kill(cli, signal.SIGUSR2)
        again.wait(timeout=STOP_WAIT_S)
    finally:
        if again.poll() is None:
            kill_tree(again)
    resumed = (run / "resumed.log").read_text()
    assert f"resumed from {run / 'checkpoints' / f'step-{step}'} at step {step}" in resumed, resumed[-4000:]
    second = _assert_stopped_with_checkpoint(run, again.returncode, ranks, signal.SIGUSR2, log=resumed,
                                             earlier=(f"step-{step}",))
    steps = metrics_steps(run)
    assert steps == list(range(1, second + 1)) and second > step + 1, steps  # each step once
    lrs = _lrs(run)  # the same command: the same schedule on both sides of the resume
    assert [lrs[s] for s in steps] == pytest.approx([cosine_lr(3e-3, 3, 100000, s - 1) for s in steps], rel=1e-12)


def _cli_pid(proc: subprocess.Popen) -> int:
    """The ``python -m fsdp_workflow`` process of ``bash -c CMD`` (bash execs a lone command; else its child)."""
    if "fsdp_workflow" in Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace"):
        return proc.pid
    (child,) = [c for c in child_pids(proc.pid)
                if "fsdp_workflow" in Path(f"/proc/{c}/cmdline").read_text(errors="replace")]
    return child


def test_a_second_ctrl_c_stops_at_once_and_leaves_only_committed_checkpoints(tmp_path: Path) -> None:
    """The first Ctrl-C starts the step's save, held open by the test hook; the second ends everything."""
    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    proc = start_cli(run, LONG_RUN, extra_env={SAVE_DELAY_ENV: "120"}, stderr_to=err)
    pids: list[int] = []
    try:
        wait_for_step(run, 1, proc)
        pids = descendants(proc.pid)
        _ctrl_c(proc)
        deadline = time.monotonic() + 60
        while not list((run / "checkpoints").glob("step-*.tmp/__1_0.distcp")) and time.monotonic() < deadline:
            time.sleep(0.1)
        t0 = time.monotonic()
        _ctrl_c(proc)
        proc.wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = err.read_text()
    assert proc.returncode == EXIT_INTERRUPTED, text[-4000:]
    assert took < 10, took
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert "stopped at once on a second Ctrl-C" in text and "Resume with: " in text, text[-4000:]
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)], "a rank or torchrun outlived the second Ctrl-C"
    # The cut-short save stays a .tmp; nothing named step-N exists that is not a complete checkpoint.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(names) == 1 and names[0].endswith(".tmp"), names
    assert not (run / "train_exit.json").exists() or json.loads((run / "train_exit.json").read_text())["exit_code"] != 0


def test_ctrl_c_while_the_ranks_start_stops_after_the_first_step_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C once both ranks are up but still importing and building: the signal is kept, step 1 is
    trained and saved, exit 75 (not a KeyboardInterrupt traceback per rank)."""
    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    proc = start_cli(run, LONG_RUN, stderr_to=err)
    try:
        deadline = time.monotonic() + 120
        while not all(f"rank {r} of 2 " in (err.read_text() if err.exists() else "") for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        assert not metrics_steps(run)  # no step trained yet
        _ctrl_c(proc)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = err.read_text()
    assert proc.returncode == EXIT_REQUEUE, text[-4000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
