"""Where a submitted run stands: the entry point of :mod:`fsdp_workflow.report.status`.

    python -m fsdp_workflow.status RUN_DIR [--json] [--watch [SECONDS]] [--plot OUT.png]
    python -m fsdp_workflow.status SWEEP_DIR

See :mod:`fsdp_workflow.report.status.__main__` for the options and exit codes.
"""

from fsdp_workflow.report.status.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
