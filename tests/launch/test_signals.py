"""SIGTERM to ``python -m fsdp_workflow`` while it prepares the data (issue 36, item 8).

    python -m pytest tests/launch/test_signals.py

``kill``, ``timeout`` and a closing terminal send SIGTERM. The local launcher forwards it
to the prepare step, which cleans up as after Ctrl-C; the command exits 143
(``EXIT_TERMINATED``) with one line saying what to do, not 241 with "exit code -15".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fsdp_workflow.core.exit_codes import EXIT_TERMINATED
from tests.train.runner import _process_env

CORPUS = Path(__file__).resolve().parents[2] / "fsdp_workflow" / "assets" / "smoke" / "corpus.txt"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _prepare_under_way(cli: subprocess.Popen, timeout_s: float = 120) -> int:
    """The prepare step's pid, once its tokenising workers are up (it is reading the data).

    The step is the launcher's child (``python -m fsdp_workflow.data.prepare``), or, in a chain
    with a verified consolidation, the child of the launcher's helper that forks the steps
    (fsdp_workflow.backends.warm), whose command line it keeps.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert cli.poll() is None, cli.communicate()
        for pid in _children(cli.pid):
            if "fsdp_workflow.data.prepare" in _cmdline(pid) and _children(pid):
                return pid
            if "fsdp_workflow.backends.warm" in _cmdline(pid):
                steps = [c for c in _children(pid) if _children(c)]
                if steps:
                    return steps[0]
        time.sleep(0.05)
    raise AssertionError("the prepare step never started its workers")


def test_sigterm_during_a_local_prepare_exits_143_and_keeps_nothing(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_text(CORPUS.read_text() * 150)  # about 90,000 records: seconds of tokenising on 2 CPUs
    run = tmp_path / "run"
    cli = subprocess.Popen([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", f"run_dir={run}",
                            f"data.path={big}", "cluster.processes_per_node=1"], env=_process_env(), cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prepare = _prepare_under_way(cli)
    time.sleep(0.5)
    os.kill(cli.pid, signal.SIGTERM)  # `kill PID`: the command alone, as timeout(1) sends it
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == EXIT_TERMINATED, err[-3000:]
    assert f"terminated (SIGTERM) while preparing the data (exit {EXIT_TERMINATED}); nothing was trained" in err, err
    assert "prepare: terminated (SIGTERM); nothing of this prepare is kept" in err, err
    assert "Run the same command again" in err and "-15" not in err and "Traceback" not in err, err[-3000:]
    assert not Path(f"/proc/{prepare}").exists()
    cache = run / "data_cache"
    assert not cache.exists() or list(cache.iterdir()) == [], list(cache.iterdir())  # no staging, no cache
    assert not (run / "checkpoints").exists() or list((run / "checkpoints").iterdir()) == []
