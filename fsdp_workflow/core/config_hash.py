"""The hash of the config that was validated, and the check every job makes against it.

Planning validates ``config.yaml``, then writes it. A job may start hours later and
reads whatever the file holds then: a hand edit (``max_stepz`` for ``max_steps``)
would run unvalidated and unrecorded. So planning records the file's sha256 in
``provenance.json`` (``config_sha256``) and in every rendered job script, and every
job (prepare, train and its requeues, consolidate, eval) compares the file with it
before it does anything (:func:`fsdp_workflow.backends.slurm.scripts.config_check_lines`). On a
mismatch the job stops at once with :data:`CONFIG_CHANGED_CAUSE` in its exit record
(:mod:`fsdp_workflow.core.job_exit`) and says how to re-plan:
``python -m fsdp_workflow.replan RUN_DIR`` validates the edited file and records it.
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Optional, Union

# The exit record's cause for a config.yaml that is not the one planned (a constant: the scripts write it).
CONFIG_CHANGED_CAUSE = "config_changed"
PROVENANCE_KEY = "config_sha256"


def config_sha256(text: Union[str, bytes]) -> str:
    """sha256 of the config's bytes (UTF-8 for text): what ``sha256sum config.yaml`` prints."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> Optional[str]:
    """sha256 of the file at ``path``; None when it cannot be read."""
    try:
        return config_sha256(Path(path).read_bytes())
    except OSError:
        return None


def replan_argv(run_dir: Path) -> list:
    """The command that validates an edited ``config.yaml`` and records it as the one planned."""
    return ["python", "-m", "fsdp_workflow.replan", str(run_dir)]


def changed_message(run_dir: Path) -> str:
    """What a job (and ``status``) says when ``config.yaml`` is not the config that was planned."""
    return (f"config.yaml changed since planning: it is not the config that was validated. To run the edited "
            f"config, validate and record it with: {shlex.join(replan_argv(run_dir))}, then submit again; "
            "or restore the planned file")


__all__ = ["CONFIG_CHANGED_CAUSE", "PROVENANCE_KEY", "changed_message", "config_sha256", "file_sha256",
           "replan_argv"]
