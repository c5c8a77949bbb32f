"""How a step runs inside the image, as data: the two calls the planner makes.

:func:`container_command` (what goes in front of a step's argv) and
:func:`srun_container_args` (srun options, for runtimes that attach to an srun
step) ask the configured runtime's class (:mod:`fsdp_workflow.container.registry`);
the policy they share is in :mod:`fsdp_workflow.container.base`, each runtime's
spelling in its own module. :mod:`fsdp_workflow.plan.render` writes the env filter
program and quotes everything.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.container.base import ContainerCommand, check_step, explicit_env
from fsdp_workflow.container.registry import runtime_for
from fsdp_workflow.core.roles import Role

__all__ = ["container_command", "explicit_env", "in_image", "srun_container_args"]


def container_command(cfg: WorkflowConfig, step: Role) -> ContainerCommand:
    """What goes in front of a step's command for the configured runtime.

    Args:
        cfg: the validated config.
        step: the job role whose command is wrapped (a :class:`~fsdp_workflow.core.roles.Role`).

    Returns:
        Nothing for ``container=none``; for pyxis the in-image ``env`` prefix
        (:func:`srun_container_args` carry the image); for Apptainer and Charliecloud
        the env filter and the whole runtime command.

    Raises:
        ValueError: an unknown step, or a bind that cannot be parsed.
    """
    check_step(step)
    return runtime_for(cfg).command(cfg, step)


def srun_container_args(cfg: WorkflowConfig, step: Role) -> List[str]:
    """srun options that run a step inside the image (pyxis); empty for other runtimes.

    Raises:
        ValueError: an unknown step, or a bind that cannot be parsed.
    """
    check_step(step)
    return runtime_for(cfg).srun_args(cfg, step)


def in_image(cfg: WorkflowConfig) -> bool:
    """Whether the steps run inside an image (then ``python`` is the image's own)."""
    return runtime_for(cfg).in_image
