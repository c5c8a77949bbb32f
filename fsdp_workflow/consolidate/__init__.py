"""Streaming consolidation of sharded DCP checkpoints into verified Hugging Face models.

    from fsdp_workflow.consolidate import consolidate
    result = consolidate("runs/my-run", "runs/my-run/hf-model")

See ``python -m fsdp_workflow.consolidate --help`` and docs/consolidation.md.
"""

from .consolidation import ConsolidationResult, consolidate
from .consolidation_errors import ConsolidationError, UnsafeCheckpointError

__all__ = ["consolidate", "ConsolidationResult", "ConsolidationError", "UnsafeCheckpointError"]
