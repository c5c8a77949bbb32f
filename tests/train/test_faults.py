"""Faults injected into real 2-rank gloo runs: a rank that hangs, a full disk.

Each test starts the real trainer under torchrun (tests/train/runner.py) and
injects the fault for real: a rank stopped with SIGSTOP (through the test-only
hook ``FSDP_WORKFLOW_TEST_FAULT``, the only way to aim inside a save), a run
directory on a small tmpfs that fills up during a save. Corrupt checkpoints
(truncated or garbled on disk) are planted before the kill -9 run's resume in
tests/train/test_preemption.py. docs/reliability.md lists what each proves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.exit_codes import EXIT_DISK_FULL, EXIT_PEER_TIMEOUT
from fsdp_workflow.core.rundir import DCP_METADATA
from fsdp_workflow.train.fault_hooks import FAULT_ENV
from tests.train.runner import (
    _process_env, alive, cli_argv, cmdline, descendants, kill_tree, launch, log_text, make_run_dir, start, start_cli,
)

pytestmark = pytest.mark.slow

TIMEOUT_S = 8  # cluster.rdzv_timeout_s for the hang tests
# Beyond the timeout: the reporting rank reads the heartbeats and kills the stopped
# local peer; torchrun then stops. Measured at about 3 s here; 20 s leaves room for a loaded CI.
MARGIN_S = 20
HANG = ["train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
        f"cluster.rdzv_timeout_s={TIMEOUT_S}"]


def _exit_record(run: Path) -> dict:
    return json.loads((run / "train_exit.json").read_text())


def _hang(run: Path, fault: str, cli_args: list[str] | None = None,
          stderr_to: Path | None = None) -> tuple[float, list[int], subprocess.Popen]:
    """Run with ``fault``; return the seconds from the rank stopping to the run's end, every pid it had, the process.

    Without ``cli_args`` the trainer is started as the planner's launch command does; with
    them, through ``python -m fsdp_workflow`` (the ranks' output then goes to the run's
    ``logs/train-local.log``, and the CLI's stderr to ``stderr_to``).
    """
    if cli_args is None:
        proc = start(run, extra_env={FAULT_ENV: fault})
    else:
        proc = start_cli(run, cli_args, extra_env={FAULT_ENV: fault}, stderr_to=stderr_to)
    local_log = run / "logs" / "train-local.log"
    pids: set[int] = set()
    stopped_at = None
    try:
        deadline = time.monotonic() + 120 + TIMEOUT_S + MARGIN_S
        while proc.poll() is None and time.monotonic() < deadline:
            pids.update(descendants(proc.pid))
            if stopped_at is None and "TEST FAULT" in log_text(run) + _read(local_log):
                stopped_at = time.monotonic()
            time.sleep(0.2)
        assert proc.poll() is not None, f"the run did not end after the rank stopped:\n{log_text(run)}"
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert stopped_at is not None, log_text(run) + _read(local_log)
    return time.monotonic() - stopped_at, sorted(pids), proc


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _assert_stopped_in_save_is_reported(run: Path, took: float, pids: list[int]) -> None:
    """The last save (step 4 of 4) hung on rank 1: named, timed out, cleaned up, no complete-looking step-4."""
    log = log_text(run) + _read(run / "logs" / "train-local.log")
    assert took < TIMEOUT_S + MARGIN_S, (took, log)
    outlived = {p: (cmdline(p) or '?')[:200] for p in pids if alive(p)}
    assert not outlived, f"a process outlived the failed run: {outlived}"
    rec = _exit_record(run)
    assert rec["exit_code"] == EXIT_PEER_TIMEOUT and "rank 1 on " in rec["reason"], rec
    assert "in 'saving step 4'" in rec["reason"], rec
    assert f"waited {TIMEOUT_S} s (cluster.rdzv_timeout_s)" in rec["reason"] and "stopped answering" in rec["reason"]
    assert "rank 1 on" in log and "stopped answering" in log
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-2", "step-4.tmp"], names  # never a step-4 without its .tmp
    assert not (run / "checkpoints" / "step-4.tmp" / DCP_METADATA).exists()
    assert checkpoint_problem(run / "checkpoints" / "step-2") is None


def test_a_rank_that_stops_inside_an_async_save_leaves_no_complete_looking_step(tmp_path: Path) -> None:
    """The last save (step 4 of 4) hangs on rank 1 after its shards are written.

    Asynchronous: rank 0 finishes the loop and waits for the background save, whose
    gather runs on the separate gloo group: that group must carry cluster.rdzv_timeout_s
    too (torch's default for a new group is 30 minutes). The same report and clean-up as
    for a rank that stops mid-run (proven across two nodes in tests/multinode): the rank
    that timed out names the stopped one from its heartbeat, and kills it when it is on
    its own host. The synchronous save (rank 0 waits in DCP's gather on the default
    group) is the local CLI test below.
    """
    run = make_run_dir(tmp_path / "run", [*HANG, "checkpoint.async_save=true"])
    took, pids, _ = _hang(run, "stop_in_save@4:1")
    _assert_stopped_in_save_is_reported(run, took, pids)


# About 0.4 MB of data and assets plus one 1.8 MB checkpoint of the smoke model with its
# optimizer state fit; the second save, written while the first is still kept, runs out part-way.
FIRST_SAVE_FITS = "3200k"


def _assert_full_disk_is_reported(run: Path) -> None:
    rec = _exit_record(run)
    assert rec["exit_code"] == EXIT_DISK_FULL, rec
    assert "No space left on device" in rec["reason"] and "[Errno 28]" in rec["reason"], rec
    assert f"disk full while saving checkpoint step 4 into {run / 'checkpoints' / 'step-4.tmp'}" in rec["reason"], rec
    assert "the previous checkpoint 2 is intact" in rec["reason"] and "checkpoint.resume=auto" in rec["reason"]
    # The previous checkpoint is whole; the failed save left nothing behind (its space is free again).
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert checkpoint_problem(run / "checkpoints" / "step-2") is None
    assert rec["checkpoint"] == str(run / "checkpoints" / "step-2")


@pytest.mark.fs_size(FIRST_SAVE_FITS)
def test_a_full_disk_during_an_async_save_keeps_the_previous_checkpoint_and_says_so(small_fs: Path) -> None:
    """The background save runs out of space; the synchronous save is the local CLI test below."""
    run = make_run_dir(small_fs / "run", ["train.max_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
                                          "checkpoint.async_save=true"])
    proc = launch(run)
    assert proc.returncode != 0, log_text(run)
    _assert_full_disk_is_reported(run)


# ---------------------------------------------------------------- the local route keeps the rank's code (issue 24, item 8)
def test_a_hang_in_a_local_run_exits_76_from_the_cli_with_one_line_and_no_torchrun_traceback(tmp_path: Path) -> None:
    """``python -m fsdp_workflow``: torchrun reports any failed rank as 1 with a ChildFailedError traceback;
    the command exits with the rank's own code and names the rank, the reason and the log instead.

    The hang is rank 1 stopping inside the last, synchronous save: rank 0 waits in DCP's
    gather on the default group, times out, names rank 1 and kills it.
    """
    run, err_file = tmp_path / "run", tmp_path / "stderr.txt"
    args = ["cluster=local", "cluster.device=cpu", "train.seq_len=64", "consolidate.enabled=true",
            "checkpoint.async_save=false", *HANG]
    took, pids, proc = _hang(run, "stop_in_save@4:1", cli_args=args, stderr_to=err_file)
    err = err_file.read_text()
    assert proc.returncode == EXIT_PEER_TIMEOUT, err[-4000:]
    assert "ChildFailedError" not in err and "Traceback" not in err, err[-4000:]
    (line,) = [l for l in err.splitlines() if "training failed:" in l]
    assert f"exited with code {EXIT_PEER_TIMEOUT}" in line and "rank 1 on " in line, line
    assert f"Full log: {run / 'logs' / 'train-local.log'}" in line, line
    assert "ChildFailedError" in (run / "logs" / "train-local.log").read_text()  # kept, out of the way
    assert not (run / "hf_model").exists()
    _assert_stopped_in_save_is_reported(run, took, pids)


@pytest.mark.fs_size(FIRST_SAVE_FITS)
def test_a_full_disk_in_a_local_run_exits_74_from_the_cli_with_one_line(small_fs: Path) -> None:
    """The full disk during a synchronous save, through ``python -m fsdp_workflow`` (no code snapshot:
    the same bytes fit): the exit record of the async test above, and one line from the CLI."""
    run = small_fs / "run"
    args = ["cluster=local", "cluster.device=cpu", "cluster.code_snapshot=false", "train.seq_len=64",
            "train.max_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=1", "checkpoint.async_save=false",
            "consolidate.enabled=true"]
    res = subprocess.run(cli_argv(run, args), env=_process_env(), cwd=small_fs.parent, capture_output=True,
                         text=True, timeout=240)
    err = res.stderr
    assert res.returncode == EXIT_DISK_FULL, err[-4000:]
    assert "ChildFailedError" not in err and "Traceback" not in err, err[-4000:]
    (line,) = [l for l in err.splitlines() if "training failed:" in l]
    assert f"exited with code {EXIT_DISK_FULL}" in line and "No space left on device" in line, line
    assert not (run / "hf_model").exists()
    _assert_full_disk_is_reported(run)


@pytest.mark.parametrize("agent", ["fsdp_workflow.train.node", "torch.distributed.run"])
def test_kill_9_of_the_node_launcher_takes_its_ranks(agent: str, tmp_path: Path) -> None:
    """The agent killed outright (``kill -9``, the OOM killer) cannot stop its ranks: each rank dies with it,
    the forked ranks with the forkserver that follows the agent, ``torchrun -m``'s with the agent itself
    (issue 49, item 4). Before, both kept training under init, checkpointing into the run."""
    from tests.train.runner import launch_cmd, launch_env, log_file, rank_pids, wait_for_step

    run = make_run_dir(tmp_path / "run", ["train.max_steps=100000", "checkpoint.every_steps=0"])
    argv = launch_cmd(run)
    argv[2] = agent  # the same torchrun arguments: the preloaded launcher's, or torchrun's own
    with open(log_file(run), "ab") as out:
        proc = subprocess.Popen(argv, env=launch_env(run), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pids: list[int] = []
    try:
        wait_for_step(run, 1, proc, timeout_s=180)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, (ranks, log_text(run)[-3000:])
        pids = descendants(proc.pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15  # the forkserver, the ranks, then multiprocessing's resource tracker
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        outlived = {p: (cmdline(p) or "?")[:200] for p in pids if alive(p)}
        assert not outlived, f"outlived their launcher: {outlived}"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
