"""The commands ``status`` prints for the user to paste: resume, consolidate, status.

Every one is built with :mod:`fsdp_workflow.core.commands` (``shlex.join``, Hydra
values quoted), the same builder the local launcher prints its resume command with.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from fsdp_workflow.core.commands import hydra_value, local_resume_argv, shell
from fsdp_workflow.core.rundir import SUBMIT_SCRIPT, RunDir


def resume_argv(run: RunDir, planned: Optional[Sequence[str]], slurm: bool) -> List[str]:
    """The command that continues the run from its newest checkpoint.

    Args:
        run: the run directory.
        planned: ``provenance.json``'s ``command`` (the planner's ``sys.argv``), if recorded.
        slurm: the run was submitted to Slurm (``cluster.kind=slurm``).

    Returns:
        ``bash RUN_DIR/submit.sh`` for a Slurm run (its training job resumes with
        ``checkpoint.resume=auto``); for a local run, the planning command again with
        ``run_dir=RUN_DIR checkpoint.resume=auto``.
    """
    if slurm and run.script(SUBMIT_SCRIPT).is_file():
        return ["bash", str(run.script(SUBMIT_SCRIPT))]
    return local_resume_argv(run.root, planned)


def consolidate_argv(run: RunDir) -> List[str]:
    """Consolidate the newest complete checkpoint into the run's model directory."""
    return ["python", "-m", "fsdp_workflow.consolidate", str(run.checkpoints), str(run.hf_model)]


def status_argv(run_dir: str) -> List[str]:
    """``status`` of one run directory (a sweep's point)."""
    return ["python", "-m", "fsdp_workflow.status", str(run_dir)]


__all__ = ["consolidate_argv", "hydra_value", "resume_argv", "shell", "status_argv"]
