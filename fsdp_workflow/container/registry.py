"""``container.runtime`` value -> the :class:`~fsdp_workflow.container.base.Runtime` that implements it.

The one place a runtime is registered: adding one is a new class in this package,
a line here, its value in ``config/schema.py``'s ``ContainerRuntime``, a
``conf/container/<name>.yaml`` and a section of docs/containers.md.
"""

from __future__ import annotations

from typing import Dict

from fsdp_workflow.config.schema import ContainerRuntime, WorkflowConfig
from fsdp_workflow.container.apptainer import Apptainer
from fsdp_workflow.container.base import Runtime
from fsdp_workflow.container.charliecloud import Charliecloud
from fsdp_workflow.container.host import Host
from fsdp_workflow.container.pyxis import Pyxis

RUNTIMES: Dict[str, Runtime] = {r.name: r for r in (Host(), Apptainer(), Pyxis(), Charliecloud())}


def runtime_for(cfg: WorkflowConfig) -> Runtime:
    """The runtime ``cfg.container.runtime`` names.

    Raises:
        ValueError: a value of ``ContainerRuntime`` with no class registered (a programming error,
            caught by tests/container/test_runtimes.py).
    """
    value = ContainerRuntime(cfg.container.runtime).value
    try:
        return RUNTIMES[value]
    except KeyError:
        raise ValueError(f"container.runtime={value!r} has no implementation; known: {', '.join(RUNTIMES)}") from None
