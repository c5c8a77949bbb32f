"""``python -m fsdp_workflow.status RUN_DIR`` as a person sees it: in an 80x40 tmux pane, with --plot, --watch, --json.

The screen test starts the command in a detached tmux session (80 columns, 40 rows, UTF-8),
waits for it to print, and reads the pane back with ``tmux capture-pane -p``: exactly the
characters a person would see in that terminal, line by line.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_workflow.report.status.__main__ import main
from fsdp_workflow.report.status.watch import CLEAR

from .fixtures import MAX_STEPS, PACE_S, STEPS, loss_at, write_run

STATUS = [sys.executable, "-m", "fsdp_workflow.status"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
    env.update(LANG="C.UTF-8", LC_ALL="C.UTF-8")
    return env


def _wait(check, what: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"gave up after {timeout_s} s waiting for {what}")


def capture_80x40(argv: list) -> list:
    """The 80x40 tmux pane after ``argv`` printed (the command is kept on screen by a sleep)."""
    sock = f"fsdpw-status-{os.getpid()}"
    tmux = ["tmux", "-L", sock, "-u"]
    cmd = " ".join(shlex.quote(a) for a in argv) + "; echo '[exited]'; sleep 60"
    subprocess.run([*tmux, "new-session", "-d", "-x", "80", "-y", "40", cmd], env=_env(), check=True, timeout=30)
    try:
        def screen():
            out = subprocess.run([*tmux, "capture-pane", "-p", "-J"], capture_output=True, text=True, timeout=30,
                                 env=_env()).stdout
            return out if "[exited]" in out else None
        return _wait(screen, "the status screen").splitlines()
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


def test_an_80_column_terminal_shows_the_loss_curve_eta_and_axes(tmp_path):
    # a run directory path of usual length (pytest's tmp_path would wrap the path lines by itself)
    short = Path(tempfile.mkdtemp(prefix="st", dir="/tmp"))
    try:
        _check_screen(write_run(short / "run"))
    finally:
        shutil.rmtree(short)


def _check_screen(run) -> None:
    screen = capture_80x40([*STATUS, str(run.root)])
    text = "\n".join(screen)
    # What a person sees, top to bottom: the fixed lines (run, no jobs yet), the progress line with
    # the ETA (500 steps left at 0.5 s), then the loss chart: its title with the last loss, the
    # y-axis from the spike (9.000) down to the lowest loss, braille dots, the step axis 1..500, and
    # below it tokens/s and MFU side by side. Nothing wraps: each line fits in 80 columns.
    assert screen[0] == f"run: {run.root}"
    assert f"progress: step {STEPS} of {MAX_STEPS} (50%), {PACE_S:g} s/step (median of the last 20), ETA 4m10s" in screen
    title = next(i for i, l in enumerate(screen) if l.startswith("loss (step"))
    assert screen[title].startswith(f"loss (step {STEPS}: {loss_at(STEPS):.4f}")
    assert screen[title + 1].startswith("9.000 ┤") and screen[title + 10].startswith("2.006 ┤")
    assert screen[title + 11].lstrip().startswith("└─")
    assert screen[title + 12].split() == ["1", str(STEPS // 2), str(STEPS)]
    assert any("\u2801" <= ch <= "\u28ff" for ch in "".join(screen[title + 1:title + 11]))  # braille, not "_"
    assert any(l.startswith("tokens/s (last 8,500)") and "MFU % (last 30.50)" in l for l in screen)
    assert max(len(l) for l in screen) <= 80, text  # -J joins wrapped lines: a wrap would show here
    assert "[exited]" in text


def test_plot_writes_a_png(tmp_path):
    run = write_run(tmp_path / "run")
    out = tmp_path / "curves.png"
    assert main([str(run.root), "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (800, 800)  # 8 x 8 inches at 100 dpi: loss, tokens/s, MFU
    assert len(data) > 20_000  # three drawn panels, not an empty canvas
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_without_matplotlib_names_the_pip_command(tmp_path, monkeypatch, capsys):
    run = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, as when absent
    assert main([str(run.root), "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()


def test_json_has_the_numbers_not_the_drawing(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main([str(run.root), "--json"]) == 0
    out = capsys.readouterr().out
    p = json.loads(out)["progress"]
    assert p["eta_s"] == (MAX_STEPS - STEPS) * PACE_S and p["step"] == STEPS and p["time_left_s"] is None
    assert "\u2800" not in out and "┤" not in out


def test_watch_redraws_until_ctrl_c_then_exits_0(tmp_path):
    run = write_run(tmp_path / "run", steps=30)
    log = tmp_path / "watch.out"
    with open(log, "w") as fh:
        proc = subprocess.Popen([*STATUS, str(run.root), "--watch", "0.5"], stdout=fh, stderr=subprocess.STDOUT,
                                env=_env())
    try:
        _wait(lambda: log.read_text().count(CLEAR) >= 2, "two redraws")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert "Traceback" not in out and "loss (step 30:" in out and "Ctrl-C to stop" in out
