"""Containerised steps: binds, the Apptainer/pyxis wrapping, and their validation.

See docs/containers.md. :func:`container_command` and :func:`srun_container_args`
are the only builders of container commands; ``plan/spec.py`` calls them and
``plan/render.py`` writes the shell.
"""

from fsdp_workflow.container.binds import Bind, bind_list, bind_paths
from fsdp_workflow.container.checks import check_container_steps, container_issues
from fsdp_workflow.container.wrap import (
    PASS_ENV_NAMES,
    PASS_ENV_PREFIXES,
    STEP_USES_GPU,
    explicit_env,
    srun_container_args,
    ContainerCommand,
    EnvFilter,
    container_command,
    uses_gpu,
)

__all__ = [
    "Bind", "bind_list", "bind_paths", "check_container_steps", "container_issues", "PASS_ENV_NAMES", "PASS_ENV_PREFIXES", "STEP_USES_GPU",
    "ContainerCommand", "EnvFilter", "container_command", "explicit_env", "srun_container_args", "uses_gpu",
]
