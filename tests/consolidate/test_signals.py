"""SIGTERM, SIGKILL and a pruned checkpoint during ``python -m fsdp_workflow.consolidate`` (issue 36, item 8).

    python -m pytest tests/consolidate/test_signals.py

Through the real CLI on a real DCP checkpoint, the copy slowed by
``FSDP_WORKFLOW_TEST_COPY_DELAY_S`` so that the test acts in the middle of it:
SIGTERM (``kill``, ``timeout``, a scheduler) cleans up as Ctrl-C does and exits 143;
the staging directory a SIGKILL leaves is removed by the next consolidation into the
same OUT; a checkpoint that training prunes while it is read is named, exit 2.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import torch

from fsdp_workflow.core.exit_codes import EXIT_TERMINATED, EXIT_USAGE
from fsdp_workflow.core.rundir import DELETING_SUFFIX

from . import layouts
from .test_out_rules import _cli, _leftovers, _run_dir, _start_slow, _wait_for_copy


def test_sigterm_mid_copy_leaves_nothing_and_exits_143(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run", tensors=6)
    out = tmp_path / "out"
    proc = _start_slow(str(run), str(out), delay_s=2.0)
    _wait_for_copy(out, proc)
    proc.send_signal(signal.SIGTERM)  # `kill PID`, as timeout(1) and schedulers send it: the process alone
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # a second one while it cleans up changes nothing
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_TERMINATED, err
    assert err.strip().splitlines() == [f"terminated (SIGTERM): nothing was written to {out} (the partial output "
                                        "was removed); the checkpoint is untouched"], err
    assert not out.exists() and not _leftovers(out)
    assert (run / "checkpoints" / "step-1" / ".metadata").is_file()


def test_the_staging_a_killed_consolidation_left_is_removed_by_the_next(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run", tensors=6)
    out = tmp_path / "out"
    proc = _start_slow(str(run), str(out), delay_s=2.0)
    _wait_for_copy(out, proc)
    proc.kill()  # SIGKILL: the OOM killer, kill -9; nothing of the process runs
    proc.communicate(timeout=60)
    left = out.parent / f".{out.name}.tmp-{proc.pid}"
    assert _leftovers(out) == [left.name] and any(left.iterdir())
    live = out.parent / f".{out.name}.tmp-{os.getpid()}"  # a live process's pid: never taken for a leftover
    live.mkdir()
    res = _cli(str(run), str(out))
    assert res.returncode == 0, res.stderr
    assert f"note: removed {left}, left by a consolidation into {out} that was killed (pid {proc.pid} is gone)" \
        in res.stderr, res.stderr
    assert _leftovers(out) == [live.name]
    assert (out / "verification.json").is_file()


def test_a_checkpoint_pruned_while_it_is_read_is_named_with_exit_2(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run", tensors=6)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        layouts.save({"model": {"layer0.weight": torch.zeros(4, 4)}}, run / "checkpoints" / "step-2")
    out = tmp_path / "out"
    step = run / "checkpoints" / "step-1"
    proc = _start_slow(str(run), str(out), "--step", "1", delay_s=2.0)
    _wait_for_copy(out, proc)
    trash = step.with_name(step.name + DELETING_SUFFIX)  # as the trainer prunes (train.checkpoint._remove_dir)
    os.replace(step, trash)
    shutil.rmtree(trash)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_USAGE, err
    assert "Traceback" not in err and "FileNotFoundError" not in err, err
    assert f"error: {step}: the checkpoint was removed while it was being read" in err, err
    assert "checkpoint.keep_last" in err and f"The checkpoints in {step.parent} now: step-2" in err, err
    assert f"Nothing was written to {out}" in err and not out.exists() and not _leftovers(out)
