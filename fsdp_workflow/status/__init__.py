"""``python -m fsdp_workflow.status RUN_DIR``: the status command where the docs and every printed hint name it.

The code lives in the report stage, :mod:`fsdp_workflow.report.status`; this package is only
its stable entry point (a thin alias), so the command users paste, the scripts print
(``submit.sh``, the launcher) and the docs show keeps working.
"""

from fsdp_workflow.report.status import RunStatus, collect, format_text

__all__ = ["RunStatus", "collect", "format_text"]
