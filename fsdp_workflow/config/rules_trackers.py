"""Tracker rules: ``train.report_to`` names trackers whose packages this environment has.

A tracker is an optional extra (``pip install 'fsdp_workflow[tensorboard]'``).
A missing package is an error for a real local run, which trains in this very
environment, and a warning otherwise (a Slurm job, or a dry run, may run in
another environment: a module, a container, a site venv). The check asks
``importlib.util.find_spec``, so planning imports no tracker and no torch.
"""

from __future__ import annotations

import importlib.util
from typing import Dict, List, Tuple

from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.schema import ClusterKind, Tracker, WorkflowConfig

# tracker -> (modules any one of which serves it, the package to install, the extra)
TRACKER_PACKAGES: Dict[Tracker, Tuple[Tuple[str, ...], str]] = {
    Tracker.tensorboard: (("tensorboard", "tensorboardX"), "tensorboard"),
    Tracker.mlflow: (("mlflow",), "mlflow-skinny"),
    Tracker.wandb: (("wandb",), "wandb"),
    Tracker.trackio: (("trackio",), "trackio"),
}


def _installed(modules: Tuple[str, ...]) -> bool:
    return any(importlib.util.find_spec(m) is not None for m in modules)


def missing_tracker_packages(report_to: List[Tracker]) -> List[Tuple[Tracker, str]]:
    """``(tracker, pip package)`` for each requested tracker this environment cannot import."""
    out = []
    for tracker in dict.fromkeys(report_to):
        if tracker in TRACKER_PACKAGES:
            modules, package = TRACKER_PACKAGES[tracker]
            if not _installed(modules):
                out.append((tracker, package))
    return out


def check_trackers(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """``none`` stands alone; every other tracker's package is importable here (or may be on the cluster)."""
    chosen = list(cfg.train.report_to)
    shown = "[" + ",".join(t.value for t in chosen) + "]"
    if Tracker.none in chosen and len(set(chosen)) > 1:
        r.error("train.report_to", shown, "none means no tracker, so it cannot be listed with trackers",
                "list the trackers only (train.report_to=[tensorboard]) or train.report_to=[none]")
    hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
    for tracker, package in missing_tracker_packages(chosen):
        where = ("this run trains in this environment" if hard
                 else "fine if the job's environment (cluster.env_script, modules, container) has it")
        (r.error if hard else r.warn)(
            "train.report_to", shown,
            f"the {tracker.value} tracker needs the {package} package, which is not installed here ({where})",
            f"pip install {package}  (or pip install 'fsdp_workflow[{tracker.value}]'), "
            f"or drop {tracker.value} from train.report_to",
        )


RULES: List[Rule] = [check_trackers]
