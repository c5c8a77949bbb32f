"""Container wrapping of a step's argument list (Apptainer; pyxis goes on srun).

Returns argument lists; :mod:`fsdp_workflow.plan.render` quotes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from fsdp_workflow.config.schema import ContainerRuntime, Device, WorkflowConfig

# Variables that must cross into the container for Slurm, the launcher and the trainer.
PASS_ENV_PREFIXES = ("SLURM_", "MASTER_", "ACCELERATE_", "FSDP_", "NCCL_", "TORCH_", "CUDA_")


def bind_paths(cfg: WorkflowConfig) -> List[str]:
    """Every host path a step reads or writes: run dir, model, tokenizer, data, extras."""
    paths = [str(Path(cfg.run_dir).absolute())]
    for p in (cfg.model.name_or_path, cfg.model.tokenizer, cfg.data.path, cfg.data.eval_path,
              cfg.consolidate.output_dir, cfg.cluster.log_dir):
        if p:
            paths.append(str(Path(p).absolute()))
    paths += list(cfg.container.binds)
    out: List[str] = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out


def wrap_argv(cfg: WorkflowConfig, argv: List[str], step: str) -> List[str]:
    """Wrap ``argv`` for the configured runtime. ``step`` is ``train`` or ``consolidate``."""
    ct = cfg.container
    if ct.runtime != ContainerRuntime.apptainer:
        return list(argv)  # none: host; pyxis: srun's --container-* options carry the image
    wrapped = ["apptainer", "exec", "--cleanenv"]
    if step == "train" and cfg.cluster.device == Device.cuda:
        wrapped.append("--nv")
    for path in bind_paths(cfg):
        wrapped += ["--bind", path]
    wrapped += ["--env", "PYTHONNOUSERSITE=1"]
    for key, value in sorted(ct.env.items()):
        wrapped += ["--env", f"{key}={value}"]
    wrapped += list(ct.extra_args)
    wrapped.append(str(ct.image))
    return wrapped + list(argv)


def srun_container_args(cfg: WorkflowConfig, step: str) -> List[str]:
    """srun options that run a step inside the image (pyxis); empty for other runtimes."""
    ct = cfg.container
    if ct.runtime != ContainerRuntime.pyxis:
        return []
    mounts = ",".join(f"{p}:{p}" if ":" not in p else p for p in bind_paths(cfg))
    args = [f"--container-image={ct.image}", f"--container-mounts={mounts}", "--no-container-mount-home"]
    for key, value in sorted(ct.env.items()):
        args.append(f"--container-env={key}")
    return args + list(ct.extra_args)
