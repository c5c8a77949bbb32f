"""pyxis/enroot: the image is attached to an srun step (``srun --container-image=...``).

pyxis cannot clear the task's environment and gives the image's own values
precedence, so the in-image ``env`` unsets the variables known to make an image
run the host's Python packages, and ``--container-env`` makes the rendezvous,
``launch.env`` and ``cluster.nccl_env`` variables override the image's.
"""

from __future__ import annotations

from typing import List, Optional

from fsdp_workflow.config.accelerate_env import accelerate_env
from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import ClusterKind, Device, WorkflowConfig, run_layout
from fsdp_workflow.container.base import STEP_USES_GPU, ContainerCommand, Issues, Runtime, uses_gpu
from fsdp_workflow.container.binds import Bind, bind_list
from fsdp_workflow.core.roles import Role

# pyxis leaks the whole task environment; these would make the image run the host's Python packages.
PYXIS_UNSET = (
    "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "VIRTUAL_ENV",
    "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_PRELOAD",
)


class Pyxis(Runtime):
    """``container.runtime=pyxis``: Slurm's pyxis plugin runs each srun step in an enroot image."""

    name = "pyxis"
    image_example = "'nvcr.io#nvidia/pytorch:25.01-py3' (quoted: Hydra reads # as a comment)"
    build_hint = "containers/README.md: enroot import -o fsdp_workflow.sqsh dockerd://fsdp_workflow:0.1.0"
    bind_option = "pyxis --container-mounts"
    in_image_unset = PYXIS_UNSET

    def unbindable(self, b: Bind) -> List[str]:
        bad = super().unbindable(b)
        if any(c.isspace() for c in b.src + b.dst):  # --container-mounts splits on whitespace too
            bad.append("whitespace")
        return bad

    def image_path(self, image: str) -> Optional[str]:
        return image if image.startswith(("/", "./")) or image.endswith(".sqsh") else None

    def command(self, cfg: WorkflowConfig, step: Role) -> ContainerCommand:
        # srun's options (srun_args) carry the image: only the in-image env goes in front of the argv
        return ContainerCommand(None, self.in_image_env(cfg))

    def env_names(self, cfg: WorkflowConfig, step: Role) -> List[str]:
        """Host variables whose values must override the image's under pyxis."""
        names = {"MASTER_ADDR", "MASTER_PORT", *accelerate_env(cfg), *cfg.cluster.nccl_env}
        if not uses_gpu(cfg, step):
            names.add("NVIDIA_VISIBLE_DEVICES")
        return sorted(names)

    def srun_args(self, cfg: WorkflowConfig, step: Role) -> List[str]:
        ct = cfg.container
        args = [
            f"--container-image={ct.image}",
            "--container-mounts=" + ",".join(self.bind_arg(b) for b in bind_list(cfg)),
            "--no-container-mount-home",
            f"--container-workdir={run_layout(cfg).root}",
            "--container-env=" + ",".join(self.env_names(cfg, step)),
        ]
        if not uses_gpu(cfg, step):
            # no GPU on a CPU step: keep the enroot NVIDIA hook from looking for a driver
            args.append("--export=ALL,NVIDIA_VISIBLE_DEVICES=void")
        return args + list(ct.extra_args)

    def issues(self, cfg: WorkflowConfig) -> Issues:
        ct = cfg.container
        errors: List[Issue] = []
        if cfg.cluster.kind != ClusterKind.slurm:
            errors.append(Issue("container.runtime", "pyxis", "pyxis is a Slurm srun plugin; a local run cannot use it",
                                "container=apptainer (or cluster=slurm cluster.partition=NAME)"))
        if cfg.cluster.device == Device.cuda and ct.env.get("NVIDIA_VISIBLE_DEVICES", "all") in ("void", "none", ""):
            gpu_steps = [s for s, gpu in STEP_USES_GPU.items() if gpu]
            errors.append(Issue(
                "container.env.NVIDIA_VISIBLE_DEVICES", ct.env["NVIDIA_VISIBLE_DEVICES"],
                f"hides the GPUs from the GPU steps ({', '.join(gpu_steps)}) while cluster.device=cuda",
                "remove it from container.env (CPU steps already get NVIDIA_VISIBLE_DEVICES=void)",
            ))
        return errors, []
