"""Validation of the containerised steps, run with every other config rule.

:func:`fsdp_workflow.plan.checks.check` runs :func:`check_container_steps` after the
config stage's own rules; it reports, together with all other config errors (exit code 2):

* the image is missing (an error unless ``dry_run``);
* a path the job reads or writes cannot be bound (``:`` or ``,`` in it, a
  relative or malformed ``container.binds`` entry, whitespace under pyxis) or
  its source is missing;
* a GPU step would not see the GPUs, or a CPU step would ask for them.
"""

from __future__ import annotations

import os
from typing import List, Tuple

from fsdp_workflow.config.errors import Issue, ValidationReport
from fsdp_workflow.config.schema import ClusterKind, ContainerRuntime, Device, WorkflowConfig
from fsdp_workflow.container.binds import collect_binds, unbindable
from fsdp_workflow.container.wrap import STEP_USES_GPU
from fsdp_workflow.core.envnames import ENV_NAME_RULE, is_env_name

IMAGE_URI_SCHEMES = ("docker://", "docker-daemon://", "oras://", "library://", "shub://", "http://", "https://")
# Bind sources the planner or the run creates itself; every other source must exist.
_CREATED_BY_RUN = ("run_dir",)
_INPUT_KEYS = ("model.name_or_path", "model.tokenizer", "data.path", "data.eval_path", "checkpoint.resume")


def _image_issues(cfg: WorkflowConfig) -> Tuple[List[Issue], List[Issue]]:
    ct = cfg.container
    errors: List[Issue] = []
    warnings: List[Issue] = []
    image = ct.image or ""
    if not image:
        return errors, warnings  # rules_run reports the missing image
    is_path = ct.runtime == ContainerRuntime.apptainer and not image.startswith(IMAGE_URI_SCHEMES)
    is_path |= ct.runtime == ContainerRuntime.pyxis and (image.startswith(("/", "./")) or image.endswith(".sqsh"))
    if ct.runtime == ContainerRuntime.apptainer and not is_path:
        warnings.append(Issue(
            "container.image", image,
            "every node converts the image at each start (slow, and compute nodes may have no network)",
            f"apptainer build fsdp_workflow.sif {image} once, then container.image=/shared/path/fsdp_workflow.sif",
        ))
    if is_path and not os.path.exists(os.path.expanduser(image)):
        (warnings if cfg.dry_run else errors).append(Issue(
            "container.image", image,
            "the image does not exist on this machine" + (" (a dry run may plan for a cluster path)" if cfg.dry_run else ""),
            "build it (see containers/README.md: apptainer build fsdp_workflow.sif containers/fsdp_workflow.def) "
            "or point container.image at an existing image",
        ))
    return errors, warnings


def _bind_issues(cfg: WorkflowConfig) -> Tuple[List[Issue], List[Issue]]:
    errors: List[Issue] = []
    warnings: List[Issue] = []
    pyxis = cfg.container.runtime == ContainerRuntime.pyxis
    binds, bad = collect_binds(cfg)
    errors += [Issue(key, spec, why, "container.binds=[/abs/host/path,/abs/src:/abs/dst:ro]") for key, spec, why in bad]
    hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
    for b in binds:
        bad = unbindable(b)
        if pyxis and any(c.isspace() for c in b.src + b.dst):
            bad.append("whitespace")
        if bad:
            runtime = "pyxis --container-mounts" if pyxis else "apptainer --bind"
            errors.append(Issue(
                b.key, b.src,
                f"{runtime} cannot express a path holding {' or '.join(map(repr, bad))}, so the step would not see it",
                "use a path without them (a symlink to it works: the step sees the link's target once bound)",
            ))
        elif b.key not in _CREATED_BY_RUN + _INPUT_KEYS and not os.path.exists(b.src):
            # inputs are checked by rules_run; a missing bind source stops apptainer before the step runs
            (errors if hard else warnings).append(Issue(
                b.key, b.src,
                "a bind source must exist before the job starts" + ("" if hard else " (fine if it exists on the compute nodes)"),
                f"mkdir -p {b.src}  (or point {b.key} at an existing directory)",
            ))
    return errors, warnings


def _gpu_env_issues(cfg: WorkflowConfig) -> Tuple[List[Issue], List[Issue]]:
    ct = cfg.container
    errors: List[Issue] = []
    warnings: List[Issue] = []
    cuda = cfg.cluster.device == Device.cuda
    gpu_steps = [s for s, gpu in STEP_USES_GPU.items() if gpu]
    for key, value in ct.env.items():
        if not is_env_name(key):
            errors.append(Issue(f"container.env.{key}", value, "not a valid environment variable name",
                                f"use {ENV_NAME_RULE}"))
    if ct.runtime == ContainerRuntime.apptainer and "--nv" in ct.extra_args:
        warnings.append(Issue(
            "container.extra_args", ct.extra_args,
            f"--nv is added for the GPU steps ({', '.join(gpu_steps)}) when cluster.device=cuda; "
            "here it also reaches the CPU-only consolidation and evaluation jobs",
            "remove --nv from container.extra_args",
        ))
    if cuda and ct.runtime == ContainerRuntime.pyxis and ct.env.get("NVIDIA_VISIBLE_DEVICES", "all") in ("void", "none", ""):
        errors.append(Issue(
            "container.env.NVIDIA_VISIBLE_DEVICES", ct.env["NVIDIA_VISIBLE_DEVICES"],
            f"hides the GPUs from the GPU steps ({', '.join(gpu_steps)}) while cluster.device=cuda",
            "remove it from container.env (CPU steps already get NVIDIA_VISIBLE_DEVICES=void)",
        ))
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
    ct = cfg.container
    if ct.runtime == ContainerRuntime.none:
        unused = [k for k in ("binds", "env", "extra_args") if getattr(ct, k)]
        return [], [Issue(f"container.{k}", getattr(ct, k), "container.runtime=none runs on the host and ignores it",
                          "container=apptainer (or remove it)") for k in unused]
    errors: List[Issue] = []
    warnings: List[Issue] = []
    for part in (_image_issues, _bind_issues, _gpu_env_issues):
        e, w = part(cfg)
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
