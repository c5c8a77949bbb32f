"""The post-checkpoint hook: a run-directory script rank 0 runs after each committed checkpoint.

The trainer knows nothing of what happens to a checkpoint next (an evaluation
job on Slurm, a copy to object storage, nothing at all). The planner may write
``RUN_DIR/post_checkpoint.sh``; after ``step-N`` is renamed into place, rank 0
runs::

    bash RUN_DIR/post_checkpoint.sh N      # cwd RUN_DIR, stdin /dev/null, the trainer's environment

in a session of its own, without waiting for it. A daemon thread collects its
output and reports the outcome on stderr; a failing hook never stops training.

The one ordering guarantee: the hook of ``step-N`` has finished before any
checkpoint is pruned at a later commit, and before the trainer exits. The hook
may therefore hard-link ``step-N`` (for an evaluation that runs later) without
racing ``checkpoint.keep_last``.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

# Waiting longer than this for a hook gets a line on stderr (the wait goes on).
SLOW_HOOK_S = 10.0


@dataclass
class _Running:
    step: int
    proc: subprocess.Popen
    reporter: threading.Thread


class PostCheckpointHook:
    """Runs ``bash SCRIPT STEP`` after each commit, one at a time, and waits for it when told.

    Args:
        script: ``RunDir.post_checkpoint_hook``; nothing runs while it is not a file.
        cwd: the working directory of the hook (the run directory).
    """

    def __init__(self, script: Path, cwd: Path) -> None:
        self.script = script
        self.cwd = cwd
        self._running: Optional[_Running] = None

    def start(self, step: int) -> None:
        """Start the hook for ``step`` (waiting first for the previous one); never raises for a bad hook."""
        if not self.script.is_file():
            return
        self.wait()
        try:
            proc = subprocess.Popen(["bash", str(self.script), str(int(step))], cwd=self.cwd,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, errors="replace", start_new_session=True)
        except OSError as err:
            log.warning("%s step %d: not started: %s", self.script.name, step, err)
            return
        reporter = threading.Thread(target=_collect, args=(self.script.name, step, proc),
                                    name=f"post-checkpoint-{step}", daemon=True)
        reporter.start()
        self._running = _Running(step, proc, reporter)

    def wait(self) -> None:
        """Block until the hook started last (if any) has exited and its outcome is reported."""
        running, self._running = self._running, None
        if running is None:
            return
        running.reporter.join(SLOW_HOOK_S)
        if running.reporter.is_alive():
            log.info("waiting for %s step %d (pid %d) to finish", self.script.name, running.step, running.proc.pid)
            running.reporter.join()


def _collect(name: str, step: int, proc: subprocess.Popen) -> None:
    """Wait for the hook and print its exit code and the last line of its output."""
    out, err = proc.communicate()
    last_out = _last_line(out)
    if proc.returncode == 0:
        log.info("%s step %d: exit code 0%s", name, step, f": {last_out}" if last_out else "")
        return
    detail = "; ".join(part for part in (last_out and f"stdout: {last_out}",
                                         _last_line(err) and f"stderr: {_last_line(err)}") if part)
    log.warning("%s step %d: exit code %d (training goes on)%s", name, step, proc.returncode,
                f"; {detail}" if detail else "")


def _last_line(text: Optional[str]) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1].strip()[:500] if lines else ""

