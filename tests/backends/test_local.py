"""The local launch: what the generated ``train_node.sh`` tells torchrun about signals, and the CLI's exit code.

The end-to-end signal runs (a real CLI, real ranks) are in tests/train/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.core.rundir import REQUEUE_MARKER
from fsdp_workflow.backends.local import run_local, shown
from fsdp_workflow.core.roles import Role
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.plan.run_dir import write_run_dir
from tests.launch.test_complete_inputs import save_step

# Stands in for torchrun: parses its argv with torchrun's own parser and LaunchConfig,
# and reports what torchrun would forward, how long it would wait, and SIGUSR2's disposition.
FAKE_TORCHRUN = f"""#!{sys.executable}
import json, os, signal, sys
from torch.distributed.run import config_from_args, get_args_parser
config, _, _ = config_from_args(get_args_parser().parse_args(sys.argv[1:]))
json.dump({{"signals": config.signals_to_handle.split(","), "shutdown_timeout_s": config.shutdown_timeout,
           "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN}}, open(os.environ["REPORT"], "w"))
"""


# The tests that stand a fake torchrun on PATH plan the exec'd start, which runs it.
EXEC = "cluster.rank_start=exec"


def _bin(tmp_path: Path, name: str, text: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / name
    exe.write_text(text)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bindir


@pytest.mark.parametrize("experiment,delay_s,start", [("smoke", 30, "exec"), ("llama8b_fft", 300, "auto")])
def test_train_node_sh_makes_torchrun_forward_usr2_and_term(experiment: str, delay_s: int, start: str,
                                                            tmp_path: Path) -> None:
    """The exact script, read by torchrun's own parser: both signals forwarded, the checkpoint budget waited."""
    cfg = compose([f"+experiment={experiment}", "cluster.partition=gpu", f"run_dir={tmp_path / 'run'}",
                   f"cluster.rank_start={start}"])
    plan = write_run_dir(cfg, backend_for(cfg))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_"))}
    env.update(PATH=f"{_bin(tmp_path, 'torchrun', FAKE_TORCHRUN)}:{env['PATH']}", REPORT=str(report),
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", SLURM_NODEID="0")
    res = subprocess.run(["bash", str(plan.run_dir / "train_node.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(report.read_text())
    assert {"SIGUSR2", "SIGTERM"} <= set(got["signals"]), got
    for name in got["signals"]:
        assert isinstance(getattr(signal, name), signal.Signals), name  # torchrun looks them up by name
    assert got["shutdown_timeout_s"] == delay_s == cfg.cluster.signal_delay_s
    # until torchrun installs its handler, an early SIGUSR2 must not kill the launcher
    assert got["usr2_ignored"]


# Stands in for the interpreter the preloaded node script execs: runs the script's own command
# up to torchrun's LaunchConfig (fsdp_workflow.train.node.launch_config) and reports it.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, signal, sys
assert sys.argv[1:3] == ["-m", "fsdp_workflow.train.node"], sys.argv
from fsdp_workflow.train.node import launch_config
config, run_dir = launch_config(sys.argv[3:])
json.dump({{"signals": config.signals_to_handle.split(","), "shutdown_timeout_s": config.shutdown_timeout,
           "start_method": config.start_method, "nproc": config.nproc_per_node, "run_dir": run_dir,
           "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN}}, open(os.environ["REPORT"], "w"))
"""


def test_a_cpu_node_script_forks_its_ranks_under_torchruns_agent_with_the_same_signals(tmp_path: Path) -> None:
    """cluster.rank_start=auto on CPU: the node script runs fsdp_workflow.train.node with torchrun's
    arguments; its LaunchConfig (torchrun's parser) forwards both signals, waits the checkpoint budget,
    and starts the ranks from the forkserver."""
    cfg = compose(["+experiment=smoke", "cluster.partition=gpu", f"run_dir={tmp_path / 'run'}"])
    plan = write_run_dir(cfg, backend_for(cfg))
    script = (plan.run_dir / "train_node.sh").read_text()
    exec_line = next(line for line in script.splitlines() if line.startswith("exec "))
    assert shlex.split(exec_line)[1:4] == [sys.executable, "-m", "fsdp_workflow.train.node"], exec_line
    fake = _bin(tmp_path, "python", FAKE_PYTHON) / "python"
    (plan.run_dir / "train_node.sh").write_text(script.replace(f"exec {sys.executable} ", f"exec {fake} ", 1))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_"))}
    env.update(REPORT=str(report), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", SLURM_NODEID="0")
    res = subprocess.run(["bash", str(plan.run_dir / "train_node.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(report.read_text())
    assert {"SIGUSR2", "SIGTERM"} <= set(got["signals"]), got
    assert got["shutdown_timeout_s"] == 30 == cfg.cluster.signal_delay_s
    assert got["usr2_ignored"] and got["start_method"] == "forkserver" and got["nproc"] == 2, got
    assert got["run_dir"] == str(plan.run_dir)


def test_the_node_launcher_refuses_another_program(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.train.node", "--nproc_per_node=2", "train.py",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "-m fsdp_workflow.train RUN_DIR" in proc.stderr, proc.stderr


def test_the_log_shows_a_step_as_pasted_and_in_an_image_the_runtimes_command(tmp_path: Path) -> None:
    """The "consolidating:" line: the whole command quoted, not the environment filter's script."""
    from fsdp_workflow.plan.spec import wrap_argv

    step = ["python", "-m", "fsdp_workflow.consolidate", str(tmp_path / "my run"), "out"]
    assert shown(step) == f"python -m fsdp_workflow.consolidate '{tmp_path / 'my run'}' out"
    image = tmp_path / "img.sif"
    cfg = compose(["+experiment=smoke", "container=apptainer", f"container.image={image}", f"run_dir={tmp_path}"])
    wrapped = wrap_argv(cfg, step, Role.consolidate)
    assert wrapped[0] == "bash" and "compgen" in wrapped[2]  # the filter runs first
    line = shown(wrapped)
    assert line.startswith("apptainer exec ") and str(image) in line, line
    assert line.endswith(f"python -m fsdp_workflow.consolidate '{tmp_path / 'my run'}' out"), line
    assert "compgen" not in line and "fsdp_workflow-container-env" not in line


def test_a_stale_requeue_marker_does_not_turn_a_failure_into_75(tmp_path: Path, monkeypatch, caplog) -> None:
    """A marker left by an earlier preempted run in the same directory is forgotten before training."""
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", EXEC])
    plan = write_run_dir(cfg, backend_for(cfg))
    (plan.run_dir / REQUEUE_MARKER).write_text("step 10\n")
    failing = _bin(tmp_path, "torchrun", "#!/bin/sh\necho 'torchrun: worker failed' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", f"{failing}:{os.environ['PATH']}")
    assert run_local(plan, consolidate=False) == 1
    assert "training failed: a rank exited with code 1" in caplog.text
    assert not (plan.run_dir / REQUEUE_MARKER).exists()


@pytest.mark.parametrize("child", ["os.kill(os.getpid(), signal.SIGINT)", "sys.exit(130)"])
def test_ctrl_c_during_prepare_exits_130_with_what_to_do(child: str, tmp_path: Path, capsys) -> None:
    """A prepare step ended by Ctrl-C (killed by SIGINT, or exiting 130) is reported as such, not as a failure."""
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}"])
    plan = write_run_dir(cfg, backend_for(cfg))
    code = f"import os, signal, sys; {child}"
    prepare = plan.job("prepare")
    assert prepare is not None
    prepare.argv = ["python", "-c", code]
    assert run_local(plan, consolidate=False) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C) while preparing the data (exit 130)" in err and "Run the same command" in err
    assert not (plan.run_dir / "checkpoints").exists() or not any((plan.run_dir / "checkpoints").iterdir())


def test_the_local_launcher_runs_the_plans_chain_in_order(tmp_path: Path, capfd) -> None:
    """Each job of ``plan.chain`` runs its one command, in the chain's order (no order of its own)."""
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", "train.ema_decay=0.9"])
    plan = write_run_dir(cfg, backend_for(cfg))
    trace = tmp_path / "trace"

    def note(word: str) -> list:
        return ["sh", "-c", f'echo {word} >> "$0"', str(trace)]

    assert [j.role for j in plan.chain] == ["prepare", "train", "consolidate"]
    prepare, train, cons = plan.chain
    prepare.argv, train.argv = note("prepare"), note("train")
    cons.before_argvs, cons.argv, cons.after_argvs = [note("ema")], note("model"), [note("card")]
    assert run_local(plan, consolidate=True) == 0
    assert trace.read_text().split() == ["prepare", "train", "ema", "model", "card"]
    assert "and its EMA" in capfd.readouterr().out
    trace.unlink()
    assert run_local(plan, consolidate=False) == 0
    assert trace.read_text().split() == ["prepare", "train"]


@pytest.mark.parametrize("trained_to", ["max_steps", "fewer"])
def test_the_same_command_after_the_run_ended_runs_nothing(trained_to: str, tmp_path: Path, monkeypatch,
                                                           capfd) -> None:
    """A finished run with its model is not trained or merged again; an earlier, shorter run's model is replaced."""
    import dataclasses

    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", EXEC])
    plan = write_run_dir(cfg, backend_for(cfg))
    last = plan.max_steps if trained_to == "max_steps" else plan.max_steps // 2
    save_step(plan.layout.step_dir(last))  # a real DCP save: "complete" checks it as resume does
    plan.layout.hf_model.mkdir()
    ran, merged = tmp_path / "ran", tmp_path / "merged"
    fake = _bin(tmp_path, "torchrun", "#!/bin/sh\ntouch " + shlex.quote(str(ran)) + "\n")
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    consolidate = dataclasses.replace(plan.consolidate, argv=["python", "-c", f"open({str(merged)!r}, 'w')"],
                                      before_argvs=[], after_argvs=[])
    plan = dataclasses.replace(plan, chain=[plan.train, consolidate])
    assert run_local(plan, consolidate=True) == 0
    out = capfd.readouterr().out
    if trained_to == "max_steps":
        assert f"this run is complete (trained to step {last} of train.max_steps={last}); the model is in " \
               f"{plan.layout.hf_model}. Nothing run." in out, out
        assert f"a larger train.max_steps and checkpoint.resume={plan.layout.step_dir(last)}; the longer run's " \
               "model replaces this one" in out, out
        assert not ran.exists() and not merged.exists()
    else:  # the local consolidation overwrites (--overwrite) once the longer run's model is verified
        assert "complete" not in out and ran.exists() and merged.exists()


# ---------------------------------------------------------------- one run per run directory (issue 24, item 4)
HOLD = """import sys, time
from fsdp_workflow.core.lock import acquire
lock = acquire(sys.argv[1], "someone else's trainer")
print("held", flush=True)
time.sleep(600)
"""


def _holder(lock_path: Path) -> subprocess.Popen:
    """An unrelated process (not an ancestor of the trainer) that holds ``lock_path``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_run_local_refuses_a_run_dir_locked_by_another_process(tmp_path: Path, monkeypatch, caplog) -> None:
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", EXEC])
    plan = write_run_dir(cfg, backend_for(cfg))
    ran = tmp_path / "ran"
    fake = _bin(tmp_path, "torchrun", "#!/bin/sh\ntouch " + shlex.quote(str(ran)) + "\n")
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    holder = _holder(plan.layout.lock)
    try:
        assert run_local(plan, consolidate=False) == 2
    finally:
        holder.kill()
        holder.wait()
    assert f"pid {holder.pid}" in caplog.text and "someone else's trainer" in caplog.text, caplog.text
    assert not ran.exists()  # nothing started
    assert run_local(plan, consolidate=False) == 0 and ran.exists()  # freed by the kernel when it died


@pytest.mark.slow
def test_two_local_runs_on_one_run_dir_the_second_is_refused_the_first_finishes(tmp_path: Path) -> None:
    from tests.train.runner import kill_tree, log_text, metrics_steps, start_cli, wait_for_step, cli_argv, _process_env

    run = tmp_path / "run"
    args = ["cluster=local", "cluster.device=cpu", "train.seq_len=64", "train.max_steps=12",
            "checkpoint.every_steps=0", "consolidate.enabled=false"]
    first = start_cli(run, args)
    try:
        wait_for_step(run, 1, first)
        # The lock names the command that planned the run: it holds it through the run, not only while planning.
        assert json.loads((run / ".lock").read_text())["pid"] == first.pid
        # Freeze the first launcher (it keeps its lock) so that, however loaded the machine, the
        # second command starts while the first run is unfinished; it finishes once thawed.
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            second = subprocess.run(cli_argv(run, args), env=_process_env(), cwd=tmp_path, capture_output=True,
                                    text=True, timeout=120)
            took = time.monotonic() - t0
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        first.wait(timeout=180)
    finally:
        if first.poll() is None:
            kill_tree(first)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"pid {first.pid}" in second.stderr and f"host {socket.gethostname()}" in second.stderr, second.stderr
    assert "run directory in use" in second.stderr, second.stderr
    assert took < 60, took
    assert first.returncode == 0, log_text(run)[-3000:]
    assert metrics_steps(run) == list(range(1, 13))
    # Released when the run ended: the same command runs again, finds the run complete and trains nothing.
    train_log = run / "logs" / "train-local.log"
    logged = train_log.read_bytes()
    again = subprocess.run(cli_argv(run, args), env=_process_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run is complete (trained to step 12 of train.max_steps=12" in again.stdout, again.stdout
    assert "Nothing run." in again.stdout and "training:" not in again.stdout + again.stderr
    assert train_log.read_bytes() == logged and metrics_steps(run) == list(range(1, 13))


@pytest.mark.slow
def test_a_trainer_started_by_hand_on_a_locked_run_dir_is_refused(tmp_path: Path) -> None:
    """Rank 0 run directly (no torchrun), and a 2-rank torchrun: both stop with one line, writing nothing."""
    from tests.train.runner import launch, launch_env, log_text, make_run_dir

    run = make_run_dir(tmp_path / "run", ["train.max_steps=2"])
    before = sorted(p.name for p in run.iterdir())
    holder = _holder(run / ".lock")
    try:
        direct = subprocess.run([sys.executable, "-m", "fsdp_workflow.train", str(run)], env=launch_env(run),
                                capture_output=True, text=True, timeout=120)
        both = launch(run)
    finally:
        holder.kill()
        holder.wait()
    assert direct.returncode == 2, direct.stderr[-3000:]
    line = next(l for l in direct.stderr.splitlines() if "is in use by" in l)
    assert f"pid {holder.pid}" in line and "someone else's trainer" in line, direct.stderr
    assert "Traceback" not in direct.stderr
    log = log_text(run)
    assert both.returncode != 0 and log.count("is in use by someone else's trainer") == 2, log[-3000:]
    assert "exitcode  : 2" in log, log[-3000:]
    # Nothing written into the run: no metrics, no checkpoint, no heartbeat, no exit record.
    assert sorted(p.name for p in run.iterdir()) == sorted([*before, ".lock"])


def _alive_of(pids: list) -> list:
    from tests.train.runner import alive, cmdline

    return [f"{pid} ({cmdline(pid)})" for pid in pids if alive(pid)]


@pytest.mark.slow
@pytest.mark.parametrize("start", ["auto", "exec"])  # a CPU run's forked ranks; torchrun -m, a GPU run's default
def test_kill_9_of_the_cli_takes_its_launcher_and_ranks_and_the_lock_covers_them_until_then(
        start: str, tmp_path: Path) -> None:
    """``kill -9`` of ``python -m fsdp_workflow`` mid-training: no orphan rank, no second writer (issue 49, item 4).

    The command's processes are frozen (SIGSTOP) before the kill, so that however loaded the
    machine, the same command runs while they still live: it must be refused, naming a live
    process of the run (the killed command's own pid is gone). Thawed, they die of the
    parent-death signal (the launcher stops its ranks, which checkpoint the step they are in),
    and the same command then resumes the run (once: that part does not depend on the start).
    """
    from tests.train.runner import (cli_argv, descendants, kill_tree, log_text, metrics_steps, rank_pids,
                                    start_cli, wait_for_step, _process_env)

    run = tmp_path / "run"
    args = ["cluster=local", "cluster.device=cpu", "cluster.processes_per_node=2", "train.seq_len=64",
            "train.max_steps=100000", "checkpoint.every_steps=0", "consolidate.enabled=false",
            f"cluster.rank_start={start}"]
    first = start_cli(run, args)
    family: list = []
    try:
        wait_for_step(run, 1, first, timeout_s=180)
        family = descendants(first.pid)  # the node launcher, its forkserver and resource tracker, the ranks
        launchers = [p for p in family if rank_pids(p)]
        assert len(launchers) == 1 and len(rank_pids(launchers[0])) == 2, (family, log_text(run)[-3000:])
        for pid in family:
            os.kill(pid, signal.SIGSTOP)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        second = subprocess.Popen(cli_argv(run, args), env=_process_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, second_err = second.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # it trains: the same command was accepted beside the killed one's ranks
            kill_tree(second)
            second_err = "(accepted: still running after 120 s) " + log_text(run)[-2000:]
        finally:
            for pid in family:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        # Refused while they live, naming them: before, the lock went with the killed command and
        # the second command trained into the same directory beside the orphans.
        assert second.returncode == 2, (second.returncode, second_err[-3000:], _alive_of(family))
        assert "run directory in use" in second_err, second_err[-3000:]
        assert f"pid {first.pid}" in second_err and "has ended" in second_err, second_err[-3000:]
        assert f"pid {launchers[0]}" in second_err, second_err[-3000:]
        t0 = time.monotonic()
        while _alive_of(family) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        took = time.monotonic() - t0
        assert not _alive_of(family), f"outlived the command by {took:.0f} s: {_alive_of(family)}"
    finally:
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert took < 30, took  # a step and its checkpoint on a tiny model; torchrun's own limit is 30 s
    # The launcher stopped its ranks as a scheduler's SIGTERM does: the step they were in is saved.
    info = json.loads((run / "train_exit.json").read_text())
    assert info["exit_code"] == 75 and "SIGTERM" in info["reason"], info
    step = info["step"]
    assert (run / "checkpoints" / f"step-{step}" / ".metadata").is_file()
    if start != "auto":
        return
    # Gone, they hold nothing: the same command resumes from that checkpoint and trains on.
    again = start_cli(run, args)
    try:
        wait_for_step(run, step + 1, again, timeout_s=180)
    finally:
        kill_tree(again)
    assert f"resumed from {run / 'checkpoints' / f'step-{step}'}" in log_text(run)
    assert max(metrics_steps(run)) > step


# ---------------------------------------------------------------- torchrun's output (issue 24, item 8)
RANK_TRACEBACK = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/fsdp_workflow/train/loop.py", line 10, in main
    raise ValueError("the rank's own error")
ValueError: the rank's own error
"""
TORCHRUN_END = """W1125 03:54:51.240000 10899 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 11111 closing signal SIGTERM
E1125 03:54:51.244000 10899 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 65) local_rank: 0 (pid: 11110) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/usr/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
fsdp_workflow.train FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11111)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_03:54:51
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 65 (pid: 11110)
============================================================
"""


def test_output_filter_keeps_the_ranks_lines_and_drops_torchruns_traceback() -> None:
    import io

    from fsdp_workflow.backends.torchrun_io import OutputFilter

    out = io.BytesIO()
    filt = OutputFilter(out)
    text = "rank 0: training stopped at step 3\n" + RANK_TRACEBACK + "\rtrain:  10%|#   | 3/30\n" + TORCHRUN_END
    for i in range(0, len(text), 7):  # in arbitrary pieces, as a pipe delivers them
        filt.feed(text[i:i + 7].encode())
    filt.close()
    shown = out.getvalue().decode()
    assert "rank 0: training stopped at step 3\n" in shown and RANK_TRACEBACK in shown, shown
    assert "3/30" in shown  # the progress bar's partial line passes
    assert "ChildFailedError" not in shown and "torch/distributed" not in shown and "Root Cause" not in shown, shown
    assert (filt.root_rank, filt.root_code) == (1, 65)
