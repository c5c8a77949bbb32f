"""The local chain's helper that forks the data, consolidation and card steps (fsdp_workflow.backends.warm).

    python -m pytest tests/backends/test_warm.py

A real helper (it imports torch and transformers once), real steps: the model card's own
command, whose arguments decide its exit code and output. The whole chain through it is
the smoke run's, which many tests walk (tests/train, tests/families); SIGTERM to a step
forked by it: tests/launch/test_signals.py. ``kill -9`` of the launcher: the helper and its step die
with it, holding the run's lock until they are gone (the last test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from fsdp_workflow.backends.local import _run, _worth_a_helper
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.backends.warm import WarmSteps, step_module
from fsdp_workflow.config import compose
from fsdp_workflow.plan.run_dir import write_run_dir

CARD = [sys.executable, "-m", "fsdp_workflow.report.card"]


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmSteps]:
    helper = WarmSteps.start(dict(os.environ))
    assert helper is not None
    yield helper
    helper.close()
    assert helper._proc.returncode == 0  # it ends when the launcher closes its pipe


def test_a_step_runs_forked_with_its_arguments_output_and_exit_code(warm: WarmSteps, tmp_path: Path, capfd) -> None:
    pid = warm.begin([*CARD, "--help"], warm.env)
    assert pid is not None and pid != warm._proc.pid
    assert warm.wait() == 0
    assert "usage:" in capfd.readouterr().out  # the launcher's own stdout, as a started process has it
    missing = tmp_path / "no-model"
    assert _run([*CARD, str(missing)], warm.env, warm) == 2  # the card refuses a path with no model
    err = capfd.readouterr().err
    assert str(missing) in err and "Traceback" not in err


def test_a_step_runs_in_the_launchers_working_directory(warm: WarmSteps, tmp_path: Path, monkeypatch, capfd) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert _run([*CARD, "here"], warm.env, warm) == 0  # a card of what it can read, relative to the cwd
    assert (tmp_path / "here" / "README.md").is_file()
    assert "model card: here/README.md" in capfd.readouterr().out


def test_what_it_does_not_fork_runs_as_its_own_process(warm: WarmSteps) -> None:
    assert step_module([*CARD, "x"]) == "fsdp_workflow.report.card"
    assert step_module([sys.executable, "-m", "fsdp_workflow.train.node", "x"]) is None  # training: train_node.sh
    assert step_module(["apptainer", "exec", "img", "python", "-m", "fsdp_workflow.consolidate"]) is None
    assert step_module(["python", "-m", "fsdp_workflow.consolidate"]) is None  # not this interpreter
    assert warm.begin([*CARD, "--help"], {**warm.env, "PYTHONPATH": "/elsewhere"}) is None  # another start


@pytest.mark.parametrize("overrides, wanted", [
    ([], True),  # prepare, a verified consolidation and its card share one import
    (["consolidate.verify=false"], False),  # no step imports torch: each starts on its own
    (["consolidate.enabled=false"], False),
])
def test_a_helper_only_where_steps_share_its_import(overrides: list, wanted: bool, tmp_path: Path) -> None:
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", *overrides])
    plan = write_run_dir(cfg, backend_for(cfg))
    jobs = [j for j in plan.chain if cfg.consolidate.enabled or j.role != "consolidate"]
    assert _worth_a_helper(jobs) is wanted


# A launcher that starts the helper as the local chain does (holding a lock it passes on), forks a step
# that runs for minutes from it, says the pids of the helper and the step, then waits for the step. The
# step is the standard library's timeit sleeping: the helper runs any module it is sent (step_module's
# list is the launcher's own choice, widened here for it).
LAUNCHER = """
import os, sys
import fsdp_workflow.backends.warm as warm
from fsdp_workflow.core.lock import acquire
lock = acquire(sys.argv[1], "planning and launching the run (test)")
warm.MODULES = frozenset({"timeit"})
helper = warm.WarmSteps.start(dict(os.environ), (lock.fileno(),))
step = helper.begin([sys.executable, "-m", "timeit", "-n", "1", "import time; time.sleep(600)"], helper.env)
print(helper._proc.pid, step, flush=True)
helper.wait()
"""


def test_kill_9_of_the_launcher_takes_the_helper_and_its_step_and_the_lock_until_then(tmp_path: Path) -> None:
    """``kill -9`` of ``python -m fsdp_workflow`` during a forked step (issue 49, item 4): the helper gets
    SIGTERM from the kernel, its step too, and the run's lock is held until both are gone. Before, the helper
    waited for its step, which ran on under init with nothing holding the run."""
    from fsdp_workflow.core.lock import LockHeld, acquire, is_locked
    from tests.train.runner import alive

    lock = tmp_path / ".lock"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    helper, step = (int(w) for w in launcher.stdout.readline().split())
    try:
        assert alive(helper) and alive(step) and is_locked(lock)
        # Frozen, so that the lock is seen held by them alone however fast they would die.
        for pid in (helper, step):
            os.kill(pid, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        with pytest.raises(LockHeld) as held:
            acquire(lock, "planning")
        assert f"pid {launcher.pid} has ended" in str(held.value) and f"pid {helper} (" in str(held.value)
        for pid in (helper, step):
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while (alive(helper) or alive(step)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(helper) and not alive(step), "the helper or its step outlived the launcher"
    finally:
        for pid in (helper, step):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while is_locked(lock) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        acquire(lock, "planning").release()
    except LockHeld as err:
        raise AssertionError(f"the lock outlived the run's processes: {err}") from None
