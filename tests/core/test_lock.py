"""core/lock.py: a real flock between real processes; the kernel frees it when the holder dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdp_workflow.core.lock import LockHeld, acquire, is_locked, read_holder

HOLD = textwrap.dedent("""
    import sys, time
    from fsdp_workflow.core.lock import acquire
    lock = acquire(sys.argv[1], "training (test holder)")
    print("held", flush=True)
    if sys.argv[2] == "child":  # a descendant sees the lock as held on its behalf
        import subprocess
        code = ("import sys; from fsdp_workflow.core.lock import read_holder; "
                "print('ancestor', read_holder(sys.argv[1]).is_ancestor_of_me())")
        subprocess.run([sys.executable, "-c", code, sys.argv[1]], check=True)
    time.sleep(600)
""")


def _holder(path: Path, mode: str = "hold") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_taker_is_refused_with_the_holders_name_and_kill_9_frees_it(tmp_path: Path) -> None:
    path = tmp_path / "run" / ".lock"
    proc = _holder(path)
    try:
        assert is_locked(path)
        with pytest.raises(LockHeld) as info:
            acquire(path, "planning", subject="run directory X")
        msg = str(info.value)
        assert f"pid {proc.pid}" in msg and "training (test holder)" in msg and "run directory X" in msg
        assert info.value.holder is not None and info.value.holder.pid == proc.pid
        assert not info.value.holder.is_ancestor_of_me()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # the kernel released it with the process: no stale lock to delete by hand
    assert not is_locked(path)
    with acquire(path, "planning") as lock:
        assert lock.held and read_holder(path).pid == os.getpid()
    assert not is_locked(path) and read_holder(path) is None  # released and the name wiped


def test_the_lock_excludes_a_second_descriptor_in_the_same_process(tmp_path: Path) -> None:
    first = acquire(tmp_path / ".lock", "one")
    with pytest.raises(LockHeld):
        acquire(tmp_path / ".lock", "two")
    first.release()
    acquire(tmp_path / ".lock", "two").release()


def test_a_descendant_of_the_holder_knows_the_lock_is_held_for_it(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / ".lock"), "child"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        deadline = time.time() + 60
        line = proc.stdout.readline().strip()
        assert time.time() < deadline
        assert line == "ancestor True"
    finally:
        proc.kill()
        proc.wait()


# A holder that passes its descriptor to a child (as the local launcher passes the run's lock
# to the node script and its steps), says the child's pid, then sleeps until it is killed.
PASS_ON = textwrap.dedent("""
    import subprocess, sys, time
    from fsdp_workflow.core.lock import acquire
    lock = acquire(sys.argv[1], "planning and launching the run (test)")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(lock.fileno(),))
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_a_child_given_the_descriptor_holds_the_lock_after_its_holder_died_and_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run" / ".lock"
    proc = subprocess.Popen([sys.executable, "-c", PASS_ON, str(path)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        proc.kill()
        proc.wait()
        assert is_locked(path)  # the lock is the open file's: the child holds it now
        with pytest.raises(LockHeld) as info:
            acquire(path, "planning", subject="run directory X")
        msg = str(info.value)
        assert f"pid {proc.pid} has ended; processes it started still hold the lock: pid {child} (" in msg, msg
        assert "time.sleep(600)" in msg, msg
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_locked(path) and time.monotonic() < deadline:  # a killed process's descriptors close as it exits
        time.sleep(0.05)
    acquire(path, "planning").release()
