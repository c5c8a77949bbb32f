"""Apptainer (and Singularity's successor CLI): ``apptainer exec --cleanenv ... IMAGE env ... argv``.

``--cleanenv`` starts the step with an empty environment; the env filter in front
re-exports the pass-through variables as ``APPTAINERENV_*``, which Apptainer still
honours, and drops any such variable the user's shell already had.
"""

from __future__ import annotations

from typing import List, Optional

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import WorkflowConfig, run_layout
from fsdp_workflow.container.base import STEP_USES_GPU, ContainerCommand, EnvFilter, Issues, Runtime, uses_gpu
from fsdp_workflow.container.binds import Bind, bind_list
from fsdp_workflow.core.roles import Role

# Images Apptainer converts at every start rather than reading a local file.
IMAGE_URI_SCHEMES = ("docker://", "docker-daemon://", "oras://", "library://", "shub://", "http://", "https://")


class Apptainer(Runtime):
    """``container.runtime=apptainer``: a ``.sif`` file run with ``apptainer exec``."""

    name = "apptainer"
    image_example = "/path/fsdp_workflow.sif"
    build_hint = "containers/README.md: apptainer build fsdp_workflow.sif containers/fsdp_workflow.def"
    bind_option = "apptainer --bind"
    env_filter = EnvFilter()

    def bind_arg(self, b: Bind) -> str:
        """``--bind`` value: ``src`` alone for a same-path read-write bind, else ``src:dst:ro|rw``."""
        if b.src == b.dst and not b.read_only:
            return b.src
        return f"{b.src}:{b.dst}:{'ro' if b.read_only else 'rw'}"

    def image_path(self, image: str) -> Optional[str]:
        return None if image.startswith(IMAGE_URI_SCHEMES) else image

    def command(self, cfg: WorkflowConfig, step: Role) -> ContainerCommand:
        argv = ["apptainer", "exec", "--cleanenv", "--no-home"]
        if uses_gpu(cfg, step):
            argv.append("--nv")
        argv += ["--pwd", str(run_layout(cfg).root)]
        for b in bind_list(cfg):
            argv += ["--bind", self.bind_arg(b)]
        argv += list(cfg.container.extra_args)
        argv.append(str(cfg.container.image))
        return ContainerCommand(self.env_filter, argv + self.in_image_env(cfg))

    def issues(self, cfg: WorkflowConfig) -> Issues:
        ct = cfg.container
        warnings: List[Issue] = []
        image = ct.image or ""
        if image and self.image_path(image) is None:
            warnings.append(Issue(
                "container.image", image,
                "every node converts the image at each start (slow, and compute nodes may have no network)",
                f"apptainer build fsdp_workflow.sif {image} once, then container.image=/shared/path/fsdp_workflow.sif",
            ))
        if "--nv" in ct.extra_args:
            gpu_steps = [s for s, gpu in STEP_USES_GPU.items() if gpu]
            warnings.append(Issue(
                "container.extra_args", ct.extra_args,
                f"--nv is added for the GPU steps ({', '.join(gpu_steps)}) when cluster.device=cuda; "
                "here it also reaches the CPU-only consolidation and evaluation jobs",
                "remove --nv from container.extra_args",
            ))
        return [], warnings
