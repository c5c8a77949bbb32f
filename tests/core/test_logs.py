"""Logging (``fsdp_workflow.core.logs``): rank filtering, the command's log file, progress off a terminal, debug tracebacks."""

from __future__ import annotations

import os
import pty
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_workflow.core.logs import close_bar, progress_bar
from fsdp_workflow.core.rundir import PLANNER_LOG_FILE, RunDir

ROOT = Path(__file__).resolve().parents[2]

# What any module does: its own logger, one INFO and one WARNING line.
EMIT = textwrap.dedent("""
    import logging, sys
    from fsdp_workflow.core.logs import setup_logging
    setup_logging(sys.argv[1])
    log = logging.getLogger("fsdp_workflow.some.module")
    log.debug("debug line")
    log.info("info line")
    log.warning("warning line")
    logging.getLogger("some_library").info("library chatter")
""")


def _rank(rank: int, level: str = "INFO") -> str:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", EMIT, level], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # diagnostics never mix with a command's output
    return proc.stderr


def test_rank0_logs_info_other_ranks_warnings_with_a_rank_prefix() -> None:
    host = socket.gethostname()
    rank0, rank1 = _rank(0), _rank(1)
    assert f"INFO [rank 0/{host}] fsdp_workflow.some.module: info line" in rank0
    assert f"WARNING [rank 0/{host}] fsdp_workflow.some.module: warning line" in rank0
    assert "info line" not in rank1
    assert f"WARNING [rank 1/{host}] fsdp_workflow.some.module: warning line" in rank1
    assert "debug line" not in rank0 + rank1 and "library chatter" not in rank0 + rank1


def test_debug_reaches_every_rank() -> None:
    rank1 = _rank(1, "DEBUG")
    assert "DEBUG [rank 1/" in rank1 and "debug line" in rank1 and "info line" in rank1


def test_single_process_lines_carry_no_rank_prefix() -> None:
    proc = subprocess.run([sys.executable, "-c", EMIT, "INFO"], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
                               "PYTHONPATH": str(ROOT)})
    assert "INFO fsdp_workflow.some.module: info line" in proc.stderr and "[rank" not in proc.stderr


# The real command, with one log record emitted from inside its Hydra job while the
# config is checked (the command's own diagnostics are still print() calls today).
CLI_WITH_A_RECORD = textwrap.dedent("""
    import logging, runpy, sys
    import fsdp_workflow.config.validate as validate_module
    real = validate_module.validate
    def validate(*args, **kwargs):
        logging.getLogger("fsdp_workflow.config").info("checked while planning")
        return real(*args, **kwargs)
    validate_module.validate = validate
    sys.argv = ["fsdp_workflow", *sys.argv[1:]]
    runpy.run_module("fsdp_workflow", run_name="__main__")
""")


def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", CLI_WITH_A_RECORD, "+experiment=smoke", "dry_run=true", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_command_logs_to_run_dir_logs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(tmp_path, f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "checked while planning" in proc.stderr  # the console keeps the message alone
    log = (RunDir.of(run_dir).logs / PLANNER_LOG_FILE).read_text()
    # held until the run directory existed, then written with its time and level
    assert " INFO fsdp_workflow.config: checked while planning" in log


def test_an_invalid_config_leaves_no_log_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "bad"
    proc = _cli(tmp_path, f"run_dir={run_dir}", "train.micro_batch_size=0")
    assert proc.returncode == 2 and "train.micro_batch_size" in proc.stderr, proc.stderr
    assert "checked while planning" in proc.stderr
    assert not run_dir.exists()


def test_progress_is_a_bar_on_a_terminal_and_nothing_in_a_file(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            bar = progress_bar(10, desc="train", stream=tty)
            assert bar is not None
            bar.update(3)
            bar.refresh()
            close_bar(bar)
            tty.flush()
        assert b"\r" in os.read(master, 65536)  # what a terminal shows: a bar redrawn in place
    finally:
        os.close(master)
        os.close(slave)
    with open(tmp_path / "job.log", "w") as log_file:
        assert progress_bar(10, desc="train", stream=log_file) is None  # the caller logs lines instead


def test_debug_prints_the_traceback_of_a_user_error(tmp_path: Path) -> None:
    from tests.train.runner import make_run_dir

    def prepare(level: str) -> str:
        run_dir = make_run_dir(tmp_path / level, ["data=jsonl", f"data.path={tmp_path / 'missing.jsonl'}",
                                                  f"log_level={level}"], prepare_data=False)
        proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.data.prepare", str(run_dir)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 2, proc.stderr
        assert "missing.jsonl" in proc.stderr
        return proc.stderr

    info, debug = prepare("INFO"), prepare("DEBUG")
    assert "Traceback" not in info and "set log_level=DEBUG for the full traceback" in info
    assert "Traceback (most recent call last)" in debug


@pytest.mark.parametrize("level", ["info", "DEBUG"])
def test_the_level_is_read_from_the_run_config(tmp_path: Path, level: str) -> None:
    from fsdp_workflow.core.logs import recorded_log_level

    (tmp_path / "config.yaml").write_text(f"log_level: {level}\n")
    assert recorded_log_level(tmp_path) == level.upper()
    assert recorded_log_level(tmp_path / "nowhere") == "INFO"
