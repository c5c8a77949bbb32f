"""Config stage: typed schema, loading, validation and the Accelerate environment.

Nothing here imports torch or transformers.
"""

from fsdp_workflow.config.load import (
    CONF_DIR,
    PROJECT_ROOT,
    compose,
    load_run_config,
    register_resolvers,
    to_typed,
)
from fsdp_workflow.config.schema import WorkflowConfig, register_configs

__all__ = [
    "CONF_DIR",
    "PROJECT_ROOT",
    "WorkflowConfig",
    "compose",
    "load_run_config",
    "register_configs",
    "register_resolvers",
    "to_typed",
]
