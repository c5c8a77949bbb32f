"""core/lifeline.py: real processes die with the process that started them (Linux's parent-death signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux parent-death signal")

# A parent that starts a sleeping child the way the local launcher starts its steps, says
# the child's pid, then sleeps until it is killed.
PARENT = textwrap.dedent("""
    import signal, subprocess, sys, time
    from fsdp_workflow.core.lifeline import child_dies_with_me
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                             preexec_fn=child_dies_with_me(signal.SIGTERM) if sys.argv[1] == "armed" else None)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _state(pid: int) -> str:
    """The /proc state letter, '' once the process is gone (a zombie is 'Z')."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _state(pid) in ("", "Z"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["armed", "plain"])
def test_a_child_dies_with_its_parents_kill_9_only_when_armed(mode: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert _state(child) not in ("", "Z")
        parent.kill()  # SIGKILL: the parent runs nothing of its own
        parent.wait()
        # Armed, the kernel sends the child SIGTERM; without it, the child lives on under init.
        assert _gone_within(child, 10 if mode == "armed" else 2) == (mode == "armed"), (mode, _state(child))
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_parent_gone_before_the_child_asked_gets_the_signal_at_once() -> None:
    """The race the check after ``prctl`` closes: the expected parent is no longer the parent."""
    code = ("import signal, time; from fsdp_workflow.core.lifeline import arm; "
            "arm(signal.SIGTERM, 2**22 + 7); time.sleep(30)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 20


def test_the_parent_it_expects_sends_nothing_while_it_lives() -> None:
    code = ("import os, signal; from fsdp_workflow.core.lifeline import arm; "
            "print(arm(signal.SIGTERM, os.getppid()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
