"""Commands printed for a user to paste, built once for every stage that prints them.

Each is a list of arguments joined with :func:`shlex.join`, so a run directory
named ``x$(touch PWNED)y'"`` is pasted as that name and never runs anything. A
value inside a Hydra override (``run_dir=...``) is quoted for Hydra's grammar
first (:func:`hydra_value`), then the whole override for the shell.

The local launcher (after a Ctrl-C) and ``status`` (for a stopped run) print the
same resume command from here; neither may import the other.
"""

from __future__ import annotations

import re
import shlex
from typing import List, Optional, Sequence

from fsdp_workflow.core.rundir import PathLike

# Characters Hydra's override grammar takes unquoted in a path value.
_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_./+~@%:-]+")
# Overrides the resume command sets itself (Hydra's own run dir follows run_dir=).
_REPLACED = ("run_dir=", "checkpoint.resume=", "hydra.run.dir=", "hydra.sweep.dir=", "dry_run=")


def hydra_value(text: str) -> str:
    """``text`` as a Hydra override value: bare when plain, else single-quoted, quotes escaped."""
    if _HYDRA_PLAIN.fullmatch(text):
        return text
    return "'" + text.replace("'", "\\'") + "'"  # a backslash alone stays literal in Hydra


def local_resume_argv(root: PathLike, planned: Optional[Sequence[str]]) -> List[str]:
    """The planning command again, continuing the run in ``root`` from its newest checkpoint.

    Args:
        root: the run directory.
        planned: the planner's ``sys.argv`` (``provenance.json``'s ``command``), or None
            when unknown: then the bare command for the run directory.

    Returns:
        ``python -m fsdp_workflow OVERRIDES run_dir=ROOT checkpoint.resume=auto``.
    """
    kept = [str(a) for a in (planned or [])[1:] if not str(a).startswith(_REPLACED)]
    return ["python", "-m", "fsdp_workflow", *kept, f"run_dir={hydra_value(str(root))}",
            "checkpoint.resume=auto"]


def shell(argv: Sequence[str]) -> str:
    """``argv`` as one line a POSIX shell runs as exactly these arguments."""
    return shlex.join([str(a) for a in argv])


__all__ = ["hydra_value", "local_resume_argv", "shell"]
