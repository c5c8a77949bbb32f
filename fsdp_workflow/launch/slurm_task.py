"""What the submitit path runs inside each Slurm task.

submitit pickles these callables; ``python -m submitit.core._submit`` unpickles
and calls them in every task of the job. They run the very commands the plain
sbatch path runs (``bash RUN_DIR/train_node.sh``, the plan's consolidation
argv), so both submission routes launch identically.

Requeue is not submitit's: its USR2 handler would call ``scontrol requeue`` at
once, killing the ranks while they save. :class:`TrainNodeTask` replaces that
handler, waits for the trainer, and exits with the trainer's code; the job's
``teardown`` (rendered by :func:`fsdp_workflow.plan.render.requeue_lines`, the
same lines train.sbatch runs) then requeues if the trainer left ``.requeue``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Dict, List, Optional

from fsdp_workflow.launch.rendezvous import slurm_rendezvous_env
from fsdp_workflow.plan.spec import TRAIN_NODE_SCRIPT


def _exit_code(returncode: int) -> int:
    """A child's return code as a shell would report it (killed by SIGn -> 128+n)."""
    return 128 - returncode if returncode < 0 else returncode


def _note_signal(signum: int, _frame: Optional[FrameType]) -> None:
    print(f"[fsdp_workflow] {signal.Signals(signum).name} received: waiting for the trainer "
          "to checkpoint and exit", file=sys.stderr, flush=True)


def _run(argv: List[str], env: Dict[str, str]) -> int:
    # The ranks get Slurm's signals directly (every process of the step); this
    # process only waits. Replacing submitit's handlers is what stops its
    # immediate requeue.
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, _note_signal)
    proc = subprocess.Popen(argv, env=env)
    return _exit_code(proc.wait())


@dataclass
class TrainNodeTask:
    """One task per node: ``bash RUN_DIR/train_node.sh`` with the job's rendezvous variables."""

    run_dir: str
    master_port_base: int
    port_range: int
    nccl_env: Dict[str, str] = field(default_factory=dict)

    def __call__(self) -> int:
        env = dict(os.environ)
        env.update(slurm_rendezvous_env(self.master_port_base, self.port_range, self.nccl_env))
        rc = _run(["bash", str(Path(self.run_dir) / TRAIN_NODE_SCRIPT)], env)
        if rc != 0:
            # SystemExit passes through submitit untouched: the task, the step and
            # the batch shell's `rc=$?` all see the trainer's code (75: requeue me).
            raise SystemExit(rc)
        return 0


@dataclass
class CommandTask:
    """Run one command (the consolidation) and fail the job with its exit code."""

    argv: List[str]

    def __call__(self) -> int:
        argv = list(self.argv)
        if argv[:1] == ["python"]:
            argv[0] = sys.executable  # the interpreter submitit runs: same environment
        rc = _run(argv, dict(os.environ))
        if rc != 0:
            raise SystemExit(rc)
        return 0
