"""Validation of the containerised steps, run with every other config rule.

:func:`fsdp_workflow.plan.checks.check` runs :func:`check_container_steps` after the
config stage's own rules; it reports, together with all other config errors (exit code 2):

* a runtime without an image, or an image that is missing (an error unless ``dry_run``);
* a path the job reads or writes cannot be bound (a character the runtime splits
  on, a relative or malformed ``container.binds`` entry) or its source is missing;
* a container variable no shell can set, or one that hides the GPUs or lets
  ``~/.local`` in;
* then the rules only the configured runtime has (:meth:`Runtime.issues
  <fsdp_workflow.container.base.Runtime.issues>`: pyxis outside Slurm, ``--nv`` in
  Apptainer's extra arguments, a bind destination missing from a Charliecloud image...).
"""

from __future__ import annotations

import os
from typing import List, Tuple

from fsdp_workflow.config.errors import Issue, ValidationReport
from fsdp_workflow.config.schema import ClusterKind, WorkflowConfig
from fsdp_workflow.container.base import Runtime
from fsdp_workflow.container.binds import collect_binds
from fsdp_workflow.container.registry import runtime_for
from fsdp_workflow.core.envnames import ENV_NAME_RULE, is_env_name

# Bind sources the planner or the run creates itself; every other source must exist.
_CREATED_BY_RUN = ("run_dir",)
_INPUT_KEYS = ("model.name_or_path", "model.tokenizer", "data.path", "data.eval_path", "checkpoint.resume")


def _image_issues(cfg: WorkflowConfig, rt: Runtime) -> Tuple[List[Issue], List[Issue]]:
    ct = cfg.container
    errors: List[Issue] = []
    warnings: List[Issue] = []
    image = ct.image or ""
    if not image:
        errors.append(Issue("container.image", ct.image, f"container.runtime={rt.name} needs an image",
                            f"container.image={rt.image_example}"))
        return errors, warnings
    path = rt.image_path(image)
    if path is not None and not os.path.exists(os.path.expanduser(path)):
        (warnings if cfg.dry_run else errors).append(Issue(
            "container.image", image,
            "the image does not exist on this machine" + (" (a dry run may plan for a cluster path)" if cfg.dry_run else ""),
            f"build it (see {rt.build_hint}) or point container.image at an existing image",
        ))
    return errors, warnings


def _bind_issues(cfg: WorkflowConfig, rt: Runtime) -> Tuple[List[Issue], List[Issue]]:
    errors: List[Issue] = []
    warnings: List[Issue] = []
    binds, bad = collect_binds(cfg)
    errors += [Issue(key, spec, why, "container.binds=[/abs/host/path,/abs/src:/abs/dst:ro]") for key, spec, why in bad]
    hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
    for b in binds:
        bad = rt.unbindable(b)
        if bad:
            errors.append(Issue(
                b.key, b.src,
                f"{rt.bind_option} cannot express a path holding {' or '.join(map(repr, bad))}, so the step would not see it",
                "use a path without them (a symlink to it works: the step sees the link's target once bound)",
            ))
        elif b.key not in _CREATED_BY_RUN + _INPUT_KEYS and not os.path.exists(b.src):
            # inputs are checked by rules_run; a missing bind source stops the runtime before the step runs
            (errors if hard else warnings).append(Issue(
                b.key, b.src,
                "a bind source must exist before the job starts" + ("" if hard else " (fine if it exists on the compute nodes)"),
                f"mkdir -p {b.src}  (or point {b.key} at an existing directory)",
            ))
    return errors, warnings


def _env_issues(cfg: WorkflowConfig, rt: Runtime) -> Tuple[List[Issue], List[Issue]]:
    ct = cfg.container
    errors: List[Issue] = []
    warnings: List[Issue] = []
    for key, value in ct.env.items():
        if not is_env_name(key):
            errors.append(Issue(f"container.env.{key}", value, "not a valid environment variable name",
                                f"use {ENV_NAME_RULE}"))
    if "CUDA_VISIBLE_DEVICES" in ct.env:
        warnings.append(Issue(
            "container.env.CUDA_VISIBLE_DEVICES", ct.env["CUDA_VISIBLE_DEVICES"],
            "overrides the GPUs Slurm gave the job (its CUDA_VISIBLE_DEVICES passes through)",
            "remove it from container.env",
        ))
    if ct.env.get("PYTHONNOUSERSITE", "1") != "1":
        warnings.append(Issue(
            "container.env.PYTHONNOUSERSITE", ct.env["PYTHONNOUSERSITE"],
            "lets ~/.local packages shadow the image's, if a home directory is ever bound",
            "remove it from container.env",
        ))
    return errors, warnings


def collect(cfg: WorkflowConfig) -> Tuple[List[Issue], List[Issue]]:
    """``(errors, warnings)`` for the container settings of ``cfg``."""
    rt = runtime_for(cfg)
    if not rt.in_image:
        return rt.issues(cfg)
    errors: List[Issue] = []
    warnings: List[Issue] = []
    for part in (_image_issues, _bind_issues, _env_issues, lambda c, r: r.issues(c)):
        e, w = part(cfg, rt)
        errors += e
        warnings += w
    return errors, warnings


def container_issues(cfg: WorkflowConfig) -> List[Issue]:
    """The errors :func:`check_container_steps` reports (for callers without a report)."""
    return collect(cfg)[0]


def check_container_steps(cfg: WorkflowConfig, report: ValidationReport) -> None:
    """Validation rule (a :data:`fsdp_workflow.config.errors.Rule`): add errors and warnings to ``report``."""
    errors, warnings = collect(cfg)
    report.errors.extend(errors)
    report.warnings.extend(warnings)
