"""Config stage: typed schema, loading, validation and the Accelerate environment.

Nothing here imports torch or transformers. The names below are loaded on
first use, so importing one small module (``fsdp_workflow.config.schema`` for
a type) does not pull in Hydra.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CONF_DIR": "load", "PROJECT_ROOT": "load", "compose": "load", "load_run_config": "load",
    "register_resolvers": "load", "to_typed": "load",
    "WorkflowConfig": "schema", "register_configs": "schema",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"fsdp_workflow.config.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fsdp_workflow.config' has no attribute {name!r}")
