"""Containerised steps: one class per runtime, their binds, wrapping and validation.

See docs/containers.md. Each ``container.runtime`` value is one
:class:`~fsdp_workflow.container.base.Runtime` subclass (``apptainer.py``,
``pyxis.py``, ``charliecloud.py``, ``host.py`` for ``none``), registered in
``registry.py``. :func:`container_command` and :func:`srun_container_args` are the
only builders of container commands; ``plan/spec.py`` calls them and
``plan/render.py`` writes the shell words (``backends/slurm/scripts.py`` the scripts).
"""

from fsdp_workflow.container.base import (
    PASS_ENV_NAMES,
    PASS_ENV_PREFIXES,
    STEP_USES_GPU,
    ContainerCommand,
    EnvFilter,
    Runtime,
    explicit_env,
    uses_gpu,
)
from fsdp_workflow.container.binds import Bind, bind_list, bind_paths
from fsdp_workflow.container.image_checks import check_container_steps, container_issues
from fsdp_workflow.container.registry import RUNTIMES, runtime_for
from fsdp_workflow.container.wrap import container_command, in_image, srun_container_args

__all__ = [
    "Bind", "bind_list", "bind_paths", "check_container_steps", "container_issues", "PASS_ENV_NAMES",
    "PASS_ENV_PREFIXES", "STEP_USES_GPU", "ContainerCommand", "EnvFilter", "Runtime", "RUNTIMES", "runtime_for",
    "container_command", "explicit_env", "in_image", "srun_container_args", "uses_gpu",
]
