"""Write a run directory: resolved config, launch.env, job scripts, provenance.

Every run directory records what was (or would be) submitted, so a failed
job can be understood, and rerun with ``bash RUN_DIR/submit.sh``, without
the machine that planned it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

from fsdp_workflow.config.accelerate_env import accelerate_env, write_launch_env
from fsdp_workflow.config.load import PROJECT_ROOT, to_yaml
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.plan.render import render_all
from fsdp_workflow.plan.spec import CONFIG_FILE, LAUNCH_ENV_FILE, LOG_DIR, LaunchPlan, build_plan


def git_revision() -> str:
    """The project's git revision (with ``-dirty``), or ``unknown`` outside a checkout.

    Only the checkout's own ``.git`` counts: an installed package sits in site-packages,
    and a venv inside some other repository must not record that repository's revision.
    """
    if not (PROJECT_ROOT / ".git").exists():
        return "unknown"
    try:
        rev = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        return rev or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_run_dir(cfg: WorkflowConfig) -> LaunchPlan:
    """Create ``cfg.run_dir`` and write everything a launch needs into it.

    Returns:
        The plan the scripts were rendered from.
    """
    plan = build_plan(cfg)
    run_dir = plan.run_dir
    (run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / CONFIG_FILE, to_yaml(cfg))
    write_launch_env(accelerate_env(cfg), run_dir / LAUNCH_ENV_FILE)
    scripts: Dict[str, str] = render_all(plan)
    for name, text in scripts.items():
        _atomic_write(run_dir / name, text, 0o755)
    provenance = {
        "git_revision": git_revision(),
        "command": sys.argv,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.executable,
        "files": sorted([CONFIG_FILE, LAUNCH_ENV_FILE, *scripts]),
    }
    _atomic_write(run_dir / "provenance.json", json.dumps(provenance, indent=2) + "\n")
    return plan
