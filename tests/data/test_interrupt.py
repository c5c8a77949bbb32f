"""Ctrl-C during `python -m fsdp_workflow.data.prepare`: one line, exit 130, no cache left that looks complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fsdp_workflow.config.schema import run_layout

from .conftest import chat_run_dir


def _children(pid: int) -> list:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


def test_ctrl_c_mid_prepare_exits_130_with_one_message_and_keeps_nothing(tmp_path: Path) -> None:
    chat = [{"messages": [{"role": "user", "content": f"question number {i} " * 12},
                          {"role": "assistant", "content": f"the answer to {i} " * 12}]} for i in range(60000)]
    layout = run_layout(chat_run_dir(tmp_path, chat))
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_workflow.data.prepare", str(layout.root), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the tokenising workers are up: the prepare is under way
    time.sleep(0.5)
    assert proc.poll() is None, "prepare finished before it could be interrupted; give it more data"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    out, err = proc.communicate(timeout=120)
    text = out.decode() + err.decode()
    assert proc.returncode == 130, text
    assert "interrupted (Ctrl-C)" in text and "Run the same command again" in text, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    cache_root = layout.root / "data_cache"
    left = [p.name for p in cache_root.iterdir()] if cache_root.exists() else []
    assert left == [], left  # neither a staging directory nor a cache that looks complete
