"""The consolidation CLI follows the planner's rules for OUT (docs/consolidation.md, "Where OUT may go").

OUT inside the checkpoints or holding them, an existing OUT without --overwrite, a second
consolidation into the same OUT, Ctrl-C in the middle of the copy, and --remove-sharded:
each through the real CLI on a real DCP checkpoint (``dcp.save``), with
``FSDP_WORKFLOW_TEST_COPY_DELAY_S`` slowing the copy where a test must act during it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from fsdp_workflow.consolidate.consolidation import lock_path
from fsdp_workflow.consolidate.writer import COPY_DELAY_ENV
from fsdp_workflow.core.exit_codes import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_USAGE

from . import layouts

CMD = [sys.executable, "-m", "fsdp_workflow.consolidate"]


def _run_dir(root: Path, tensors: int = 4, nan: bool = False) -> Path:
    """RUN_DIR/checkpoints/step-1, written by dcp.save: ``tensors`` tensors of 64 KiB."""
    state = {f"layer{i}.weight": torch.randn(128, 128) for i in range(tensors)}
    if nan:
        state["layer0.weight"][3, 4] = float("nan")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save({"model": state}, root / "checkpoints" / "step-1")
    return root


def _cli(*argv: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *argv, "--no-progress"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def _leftovers(out: Path) -> list[str]:
    """Staging or replaced directories beside OUT (the lock file is meant to stay)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and p != lock_path(out))


def _start_slow(*argv: str, delay_s: float = 1.0) -> subprocess.Popen:
    env = {**os.environ, COPY_DELAY_ENV: str(delay_s)}
    return subprocess.Popen([*CMD, *argv, "--no-progress", "--workers", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _wait_for_copy(out: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until the first tensor's bytes are in the staging directory (the copy is under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        staged = [p for p in out.parent.glob(f".{out.name}.tmp-*/*.safetensors") if p.stat().st_size > 0]
        if staged:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the copy never started")


# ---------------------------------------------------------------- OUT inside SRC, SRC inside OUT
@pytest.mark.parametrize("extra", [[], ["--remove-sharded"]])
def test_out_inside_the_checkpoint_is_refused(tmp_path: Path, extra: list[str]) -> None:
    """``SRC SRC/out --remove-sharded`` deleted a step directory with the model inside it; now it is refused."""
    step = _run_dir(tmp_path / "run") / "checkpoints" / "step-1"
    before = sorted(p.name for p in step.iterdir())
    proc = _cli(str(step), str(step / "out"), *extra)
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr
    assert f"OUT {step / 'out'} is inside the checkpoint directory {step}" in proc.stderr, proc.stderr
    assert f"(SRC {step})" in proc.stderr
    assert sorted(p.name for p in step.iterdir()) == before


def test_out_among_the_step_directories_is_refused(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    proc = _cli(str(run), str(run / "checkpoints" / "model"))
    assert proc.returncode == EXIT_USAGE and f"is inside the checkpoint directory {run / 'checkpoints'}" in proc.stderr


def test_out_holding_the_checkpoint_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    step = run / "checkpoints" / "step-1"
    proc = _cli(str(step), str(run), "--overwrite", "--remove-sharded")
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert f"OUT {run} holds the checkpoint directory {step}" in proc.stderr
    assert (step / ".metadata").is_file() and not _leftovers(run)


def test_usual_layout_is_allowed(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    proc = _cli(str(run), str(run / "hf_model"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "hf_model" / "verification.json").read_text())["ok"]


# ---------------------------------------------------------------- an existing OUT
def test_existing_directory_is_refused_then_replaced_with_overwrite(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    proc = _cli(str(run), str(out))
    assert proc.returncode == EXIT_USAGE and "OUT exists and is not a model written by this tool" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    proc = _cli(str(run), str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file() and not _leftovers(out)


def test_empty_directory_is_written_without_overwrite(tmp_path: Path) -> None:
    """``mkdir OUT`` beforehand (or a fresh mount point): nothing in it to lose, so no --overwrite is asked for."""
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    proc = _cli(str(run), str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "verification.json"] and not _leftovers(out)


def test_earlier_output_is_refused_with_the_command_that_replaces_it(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "out"
    assert _cli(str(run), str(out)).returncode == 0
    first = (out / "verification.json").read_text()
    proc = _cli(str(run), str(out))
    assert proc.returncode == EXIT_USAGE and "OUT holds an earlier consolidation" in proc.stderr
    hint = proc.stderr.split("to replace it: ", 1)[1].strip()
    assert hint.endswith("--overwrite") and str(out) in hint
    assert (out / "verification.json").read_text() == first
    assert subprocess.run(["bash", "-c", hint], capture_output=True, text=True).returncode == 0
    assert (out / "model.safetensors").is_file() and not _leftovers(out)


def test_file_at_out_is_never_replaced(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    (tmp_path / "out").write_text("a file")
    proc = _cli(str(run), str(tmp_path / "out"), "--overwrite")
    assert proc.returncode == EXIT_USAGE and "OUT is a file" in proc.stderr
    assert (tmp_path / "out").read_text() == "a file"


# ---------------------------------------------------------------- a second consolidation, OUT appearing meanwhile
def test_second_consolidation_into_one_out_is_refused_naming_the_first(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "out"
    first = _start_slow(str(run), str(out))
    try:
        _wait_for_copy(out, first)
        t0 = time.monotonic()
        proc = _cli(str(run), str(out))
        assert time.monotonic() - t0 < 30  # at once, not after the first finished
        assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr
        assert f"is in use by consolidating on host {socket.gethostname()}, pid {first.pid}" in proc.stderr, proc.stderr
        assert "Two consolidations into one OUT are refused" in proc.stderr
    finally:
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert json.loads((out / "verification.json").read_text())["ok"]


def test_out_written_by_another_program_meanwhile_is_a_clear_message(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "out"
    proc = _start_slow(str(run), str(out))
    _wait_for_copy(out, proc)
    out.mkdir()
    (out / "theirs.txt").write_text("x")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_USAGE and "Traceback" not in err and "OSError" not in err
    assert "OUT appeared while this consolidation ran" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"] and not _leftovers(out)


# ---------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_mid_copy_leaves_nothing_and_exits_130(tmp_path: Path, presses: int) -> None:
    """SIGINT to the whole process group, as a terminal sends it, while tensors are being copied."""
    run = _run_dir(tmp_path / "run", tensors=6)
    out = tmp_path / "out"
    proc = _start_slow(str(run), str(out), delay_s=2.0)
    _wait_for_copy(out, proc)
    for _ in range(presses):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    lines = err.strip().splitlines()
    assert lines == [f"interrupted: nothing was written to {out} (the partial output was removed); the checkpoint "
                     "is untouched"], err
    assert not out.exists() and not _leftovers(out)
    assert (run / "checkpoints" / "step-1" / ".metadata").is_file()


def test_ctrl_c_with_overwrite_keeps_the_earlier_model(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run", tensors=6)
    out = tmp_path / "out"
    assert _cli(str(run), str(out)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = _start_slow(str(run), str(out), "--overwrite", delay_s=2.0)
    _wait_for_copy(out, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED and len(err.strip().splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not _leftovers(out)


# ---------------------------------------------------------------- --remove-sharded
def test_remove_sharded_keeps_the_shards_when_this_run_wrote_nothing(tmp_path: Path) -> None:
    """Refused for NaN weights, or for an existing OUT: the shards are kept, whatever OUT held before."""
    run = _run_dir(tmp_path / "run", nan=True)
    step = run / "checkpoints" / "step-1"
    proc = _cli(str(run), str(tmp_path / "out"), "--remove-sharded")
    assert proc.returncode == EXIT_NONFINITE and (step / ".metadata").is_file()
    assert _cli(str(run), str(tmp_path / "out"), "--allow-nonfinite").returncode == 0  # an earlier, verified output
    proc = _cli(str(run), str(tmp_path / "out"), "--remove-sharded")
    assert proc.returncode == EXIT_USAGE and (step / ".metadata").is_file()
    proc = _cli(str(run), str(tmp_path / "out"), "--remove-sharded", "--overwrite", "--allow-nonfinite")
    assert proc.returncode == 0, proc.stderr
    assert not step.exists() and json.loads((tmp_path / "out" / "verification.json").read_text())["ok"]


# ---------------------------------------------------------------- the planner's keys reach the command
def test_planner_passes_allow_nonfinite_and_overwrite(tmp_path: Path) -> None:
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.config.schema import run_layout
    from fsdp_workflow.plan.spec import consolidate_argv

    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}"])
    argv = consolidate_argv(cfg, run_layout(cfg))
    assert "--allow-nonfinite" not in argv and "--overwrite" in argv  # RUN_DIR/hf_model: a rerun replaces it
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", "consolidate.allow_nonfinite=true",
                   f"consolidate.output_dir={tmp_path / 'model'}"])
    argv = consolidate_argv(cfg, run_layout(cfg))
    assert "--allow-nonfinite" in argv and "--overwrite" not in argv  # a directory of the user's own: never replaced


def test_planner_accepts_an_empty_output_dir_and_refuses_a_full_one(tmp_path: Path) -> None:
    """A container's bind-mounted /output exists before the run and is empty: the consolidation job writes
    into it in place (issue 49, item 5), so planning accepts it; one holding files is still refused."""
    from fsdp_workflow.config.load import compose
    from fsdp_workflow.config.validate import validate

    out = tmp_path / "output"
    out.mkdir()
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}", f"consolidate.output_dir={out}"])
    assert [i for i in validate(cfg).errors if i.key == "consolidate.output_dir"] == []
    (out / "old.bin").write_bytes(b"x")
    errors = [i for i in validate(cfg).errors if i.key == "consolidate.output_dir"]
    assert len(errors) == 1 and "not empty" in errors[0].format(), errors
