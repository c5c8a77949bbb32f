"""A local run whose processes are gone is shown stopped, with its exit record, never with an ETA.

Real processes, not mocks: a heartbeat names the pid of a subprocess that has exited (dead)
or of one still sleeping (alive); the run lock is held by a real child process that took it
with ``core/lock.acquire`` and is then SIGKILLed, as a Ctrl-C'd launcher or a crash leaves it.
The Ctrl-C'd run has a real DCP checkpoint, the ``train_exit.json`` and ``.requeue`` the
trainer writes on a signal, and the planner's ``provenance.json`` command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.core.exit_codes import EXIT_REQUEUE
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.report.status.__main__ import main

from .fixtures import write_heartbeat, write_run


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)  # exited and reaped: the pid names no process
    return proc.pid


@pytest.fixture
def alive_pid():
    proc = subprocess.Popen(["sleep", "600"])
    yield proc.pid
    proc.kill()
    proc.wait(timeout=30)


def _report(run: RunDir, capsys) -> tuple:
    assert main([str(run.root)]) == 0
    text = capsys.readouterr().out
    assert main([str(run.root), "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def _state_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("state: "))


def test_fresh_heartbeats_whose_pids_are_dead_mean_stopped_and_no_eta(tmp_path, capsys):
    run = write_run(tmp_path / "run", alive=False)
    dead0, dead1 = _dead_pid(), _dead_pid()
    write_heartbeat(run, 0, dead0)  # beaten a moment ago, but the process is gone
    write_heartbeat(run, 1, dead1, age_s=2.0)
    text, js = _report(run, capsys)
    assert _state_line(text).startswith("state: stopped (no process of this run is alive: the run lock is free; "
                                        f"rank 0 pid {dead0} on ")
    assert f"rank 1 pid {dead1} on " in _state_line(text) and "gone" in _state_line(text)
    assert "ETA" not in text and js["progress"]["eta_s"] is None and js["state"] == "stopped"
    assert [b["alive"] for b in js["heartbeats"]] == [False, False]


def test_one_live_rank_means_running_with_an_eta(tmp_path, capsys, alive_pid):
    run = write_run(tmp_path / "run", alive=False)
    write_heartbeat(run, 0, alive_pid)
    write_heartbeat(run, 1, _dead_pid())
    text, js = _report(run, capsys)
    assert _state_line(text).startswith("state: running (rank 0 on ") and f"(pid {alive_pid}," in text
    assert "ETA 4m10s" in text and js["progress"]["eta_s"] == 250.0


def test_a_live_pid_with_a_stale_beat_is_not_counted_and_another_hosts_fresh_beat_is(tmp_path, capsys, alive_pid):
    run = write_run(tmp_path / "run", alive=False)
    write_heartbeat(run, 0, alive_pid, age_s=60.0, interval_s=5.0)  # 12 intervals: a reused pid, not our rank
    text, js = _report(run, capsys)
    assert js["state"] == "stopped" and "ETA" not in text
    assert f"rank 0 pid {alive_pid} on " in text and "silent, last beat 1m00s ago" in text
    write_heartbeat(run, 1, 4242, host="another-node")  # fresh, on a host whose pids we cannot see
    text, js = _report(run, capsys)
    assert js["state"] == "running" and "rank 1 on another-node (pid 4242" in text and "ETA" in text


def test_the_run_lock_held_by_a_live_process_means_running_and_its_death_frees_it(tmp_path, capsys):
    run = write_run(tmp_path / "run", alive=False)
    write_heartbeat(run, 0, _dead_pid())
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from fsdp_workflow.core.lock import acquire; "
         "acquire(sys.argv[1], 'training (local launcher)'); print('held', flush=True); time.sleep(600)",
         str(run.lock)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        text, js = _report(run, capsys)
        assert js["state"] == "running" and "ETA" in text
        assert "training (local launcher) on host" in _state_line(text) and f"pid {holder.pid}" in _state_line(text)
    finally:
        holder.send_signal(signal.SIGKILL)  # no release, no cleanup: the kernel frees the flock
        holder.wait(timeout=30)
    text, js = _report(run, capsys)
    assert js["state"] == "stopped" and "ETA" not in text


def test_a_killed_commands_processes_holding_its_lock_are_named_running(tmp_path, capsys):
    """``kill -9`` of the command: until its node launcher and ranks have stopped, they hold its lock
    (issue 49, item 4); ``status`` says running and names them, not only the dead command."""
    run = write_run(tmp_path / "run", alive=False)
    code = ("import subprocess, sys, time; from fsdp_workflow.core.lock import acquire; "
            "lock = acquire(sys.argv[1], 'planning and launching the run (python -m fsdp_workflow)'); "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], pass_fds=(lock.fileno(),)); "
            "print(child.pid, flush=True); time.sleep(600)")
    command = subprocess.Popen([sys.executable, "-c", code, str(run.lock)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    child = int(command.stdout.readline())
    try:
        command.kill()
        command.wait(timeout=30)
        text, js = _report(run, capsys)
        assert js["state"] == "running", text
        assert (f"pid {command.pid} has ended; processes it started still hold the lock: pid {child} ("
                in _state_line(text)), _state_line(text)
    finally:
        os.kill(child, signal.SIGKILL)


def _dcp_checkpoint(path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=str(path))


def test_a_ctrl_c_run_shows_its_exit_record_checkpoint_and_the_resume_command(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=20, alive=False)
    _dcp_checkpoint(run.step_dir(20))
    run.train_exit.write_text(json.dumps({"exit_code": EXIT_REQUEUE, "reason": "interrupted (SIGINT)", "step": 20,
                                          "checkpoint": str(run.step_dir(20))}))
    run.requeue_marker.write_text("step 20\n")
    run.provenance.write_text(json.dumps({"command": ["/x/fsdp_workflow/__main__.py", "+experiment=smoke",
                                                      f"run_dir={run.root}", "train.max_steps=1000"]}))
    write_heartbeat(run, 0, _dead_pid(), age_s=30.0)
    text, js = _report(run, capsys)
    assert js["state"] == "stopped" and "ETA" not in text
    assert "trainer exit: 75 (preempted after a checkpoint; requeue): interrupted (SIGINT) at step 20" in text
    assert f"  checkpoint it reached: {run.step_dir(20)}" in text.splitlines()
    assert "latest checkpoint: step 20  (.requeue marker present: stopped on a signal)" in text
    resume = f"python -m fsdp_workflow +experiment=smoke train.max_steps=1000 run_dir={run.root} checkpoint.resume=auto"
    assert f"resume with: {resume}" in text.splitlines() and js["resume_command"] == resume
    assert js["consolidate_command"] == f"python -m fsdp_workflow.consolidate {run.checkpoints} {run.hf_model}"


def test_a_finished_run_is_finished_and_offers_no_resume(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=20, alive=False)
    _dcp_checkpoint(run.step_dir(20))
    run.train_exit.write_text(json.dumps({"exit_code": 0, "reason": "finished", "step": 20}))
    text, js = _report(run, capsys)
    assert js["state"] == "finished" and js["resume_command"] == "" and "ETA" not in text


@pytest.mark.parametrize("kind", ["directory", "missing parent", "existing directory with a file name"])
def test_plot_into_a_directory_or_unwritable_path_is_refused_before_anything_is_written(tmp_path, capsys, kind):
    run = write_run(tmp_path / "run", steps=20)
    target = {"directory": tmp_path / "plots",
              "missing parent": tmp_path / "nowhere" / "loss.png",
              "existing directory with a file name": tmp_path / "loss.png"}[kind]
    if kind != "missing parent":
        target.mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main([str(run.root), "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--plot {target}: " in err and ("is a directory" in err or "does not exist" in err)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no .tmp, nothing


def test_write_png_leaves_no_tmp_when_the_rename_fails(tmp_path):
    from fsdp_workflow.report.curves import read_series
    from fsdp_workflow.report.plot import write_png

    run = write_run(tmp_path / "run", steps=20)
    (tmp_path / "out.png").mkdir()
    (tmp_path / "out.png" / "x").write_text("")  # a non-empty directory: os.replace fails
    with pytest.raises(OSError):
        write_png(read_series(run.metrics), tmp_path / "out.png")
    assert not list(tmp_path.glob(".*.tmp"))
