"""The names inside a Hugging Face model directory that this package writes or reads.

The consolidator writes them (:mod:`fsdp_workflow.consolidate`), the model card adds
to them (:mod:`fsdp_workflow.report.card`), and the planner, the run record and the
evaluation job ask whether they are there. Each name is defined here once
(``tests/test_imports.py`` refuses it as a literal anywhere else), as
:mod:`fsdp_workflow.core.rundir` owns the run directory's.
"""

from __future__ import annotations

VERIFICATION_FILE = "verification.json"  # the consolidator's report; a model directory holding it was verified
SINGLE_FILE = "model.safetensors"  # the one weights file transformers writes without an index
INDEX_FILE = "model.safetensors.index.json"  # the weight map of a sharded model (as save_pretrained writes it)
CARD_FILE = "README.md"  # the model card: the Hub renders a repository's README.md; a base model's declares its licence
CURVE_FILE = "loss_curve.png"  # beside the card, drawn from metrics.jsonl

__all__ = ["CARD_FILE", "CURVE_FILE", "INDEX_FILE", "SINGLE_FILE", "VERIFICATION_FILE"]
