"""``RUN_DIR/post_checkpoint.sh STEP``: run by rank 0 after each committed checkpoint, never fatal."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from fsdp_workflow.core.rundir import RunDir, list_checkpoints, step_name
from fsdp_workflow.train.hooks import PostCheckpointHook
from tests.train.runner import launch, log_text, make_run_dir

# Records its step, whether that checkpoint was complete when it looked (after a
# second, by which time the next commit would have pruned it had the trainer not
# waited), and its working directory; step 4 fails.
HOOK = """\
sleep 1
if [ -f "checkpoints/step-$1/.metadata" ]; then state=complete; else state=missing; fi
echo "$1 $state $PWD" >> hook.log
echo "hooked $1"
if [ "$1" = 4 ]; then echo "step 4 fails on purpose" >&2; exit 3; fi
"""


def test_hook_runs_in_the_run_dir_and_reports_its_outcome(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fsdp_workflow")
    run = RunDir.of(tmp_path)
    hook = PostCheckpointHook(run.post_checkpoint_hook, cwd=run.root)
    hook.start(1)  # no script: nothing runs
    hook.wait()
    run.post_checkpoint_hook.write_text('echo "$1 $PWD" > seen; echo first; echo "done $1"\n')
    hook.start(3)
    hook.wait()
    assert (tmp_path / "seen").read_text() == f"3 {os.path.realpath(tmp_path)}\n"
    run.post_checkpoint_hook.write_text('echo partial; echo "bad $1" >&2; exit 5\n')
    hook.start(4)
    hook.wait()
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("INFO", "post_checkpoint.sh step 3: exit code 0: done 3") in logged
    assert ("WARNING", "post_checkpoint.sh step 4: exit code 5 (training goes on); stdout: partial; stderr: bad 4") in logged


@pytest.mark.slow
def test_trainer_runs_hook_after_each_commit_and_survives_its_failure(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path / "run", [
        "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=1", "checkpoint.async_save=true",
    ])
    run = RunDir.of(run_dir)
    run.post_checkpoint_hook.write_text(HOOK)
    proc = launch(run_dir)
    log = log_text(run_dir)
    assert proc.returncode == 0, log
    # Every step, in order, each complete when its hook looked (pruning waited for
    # the hook), the last one finished before the trainer exited.
    real = os.path.realpath(run_dir)
    assert (run_dir / "hook.log").read_text().splitlines() == [f"{s} complete {real}" for s in (2, 4, 6)]
    assert "post_checkpoint.sh step 2: exit code 0: hooked 2" in log
    assert "post_checkpoint.sh step 4: exit code 3 (training goes on); stdout: hooked 4; " \
           "stderr: step 4 fails on purpose" in log
    assert "post_checkpoint.sh step 6: exit code 0: hooked 6" in log
    assert [p.name for _, p in list_checkpoints(run.checkpoints)] == [step_name(6)]
    assert log.count("post_checkpoint.sh step") == 3  # rank 0 only
