"""``python -m fsdp_workflow.status RUN_DIR``: where a submitted run stands (the report stage's status).

:mod:`.collect` reads the run record (:class:`fsdp_workflow.config.record.RunRecord`),
the run's backend (its jobs' states) and the checkpoints into a ``RunStatus``; :mod:`.text` renders it
for a terminal; :mod:`.__main__` is the command line, run as ``python -m
fsdp_workflow.status`` through the thin :mod:`fsdp_workflow.status` entry point.
:mod:`.eta` (pace, ETA, Slurm time left, requeues), :mod:`.text_curves` (terminal curves),
:mod:`.plot_option` (``--plot``) and :mod:`.watch` (``--watch``) add the progress part.
"""

from fsdp_workflow.report.status.collect import RunStatus, collect
from fsdp_workflow.report.status.text import format_text

__all__ = ["RunStatus", "collect", "format_text"]
