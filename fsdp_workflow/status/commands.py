"""The commands ``status`` prints for the user to paste: resume, consolidate, status.

Every one is a list of arguments joined with :func:`shlex.join`, so a run directory
named ``x$(touch PWNED)y'"`` is pasted as that name and never runs anything. A
value inside a Hydra override (``run_dir=...``) is quoted for Hydra's grammar first
(:func:`hydra_value`), then the whole override for the shell.
"""

from __future__ import annotations

import re
import shlex
from typing import List, Optional, Sequence

from fsdp_workflow.core.rundir import SUBMIT_SCRIPT, RunDir

# Characters Hydra's override grammar takes unquoted in a path value.
_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_./+~@%:-]+")
# Overrides the resume command sets itself (Hydra's own run dir follows run_dir=).
_REPLACED = ("run_dir=", "checkpoint.resume=", "hydra.run.dir=", "hydra.sweep.dir=", "dry_run=")


def hydra_value(text: str) -> str:
    """``text`` as a Hydra override value: bare when plain, else single-quoted, quotes escaped."""
    if _HYDRA_PLAIN.fullmatch(text):
        return text
    return "'" + text.replace("'", "\\'") + "'"  # a backslash alone stays literal in Hydra


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
    kept = [str(a) for a in (planned or [])[1:] if not str(a).startswith(_REPLACED)]
    return ["python", "-m", "fsdp_workflow", *kept, f"run_dir={hydra_value(str(run.root))}",
            "checkpoint.resume=auto"]


def consolidate_argv(run: RunDir) -> List[str]:
    """Consolidate the newest complete checkpoint into the run's model directory."""
    return ["python", "-m", "fsdp_workflow.consolidate", str(run.checkpoints), str(run.hf_model)]


def status_argv(run_dir: str) -> List[str]:
    """``status`` of one run directory (a sweep's point)."""
    return ["python", "-m", "fsdp_workflow.status", str(run_dir)]


def shell(argv: Sequence[str]) -> str:
    """``argv`` as one line a POSIX shell runs as exactly these arguments."""
    return shlex.join([str(a) for a in argv])


__all__ = ["consolidate_argv", "hydra_value", "resume_argv", "shell", "status_argv"]
