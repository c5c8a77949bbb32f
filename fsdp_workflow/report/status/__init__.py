"""``python -m fsdp_workflow.status RUN_DIR``: where a submitted run stands.

:mod:`.collect` reads the run directory, Slurm and the checkpoints into a
``RunStatus``; :mod:`.text` renders it for a terminal; :mod:`.__main__` is the
command line. :mod:`.eta` (pace, ETA, Slurm time left, requeues), :mod:`.curves`
(terminal curves), :mod:`.plot` (``--plot``) and :mod:`.watch` (``--watch``) add
the progress part.
"""

from fsdp_workflow.report.status.collect import RunStatus, collect
from fsdp_workflow.report.status.text import format_text

__all__ = ["RunStatus", "collect", "format_text"]
