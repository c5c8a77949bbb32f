"""``container.runtime=none``: every step runs on the host, unwrapped."""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.container.base import ContainerCommand, Issues, Runtime
from fsdp_workflow.core.roles import Role


class Host(Runtime):
    """No image: the wrapper adds nothing, and container settings that would be ignored are flagged."""

    name = "none"
    in_image = False

    def command(self, cfg: WorkflowConfig, step: Role) -> ContainerCommand:
        return ContainerCommand(None)

    def issues(self, cfg: WorkflowConfig) -> Issues:
        ct = cfg.container
        warnings: List[Issue] = []
        if ct.image:
            warnings.append(Issue("container.image", ct.image, "container.runtime=none ignores the image",
                                  "container=apptainer (or container.image=null)"))
        warnings += [Issue(f"container.{k}", getattr(ct, k), "container.runtime=none runs on the host and ignores it",
                           "container=apptainer (or remove it)") for k in ("binds", "env", "extra_args") if getattr(ct, k)]
        return [], warnings
