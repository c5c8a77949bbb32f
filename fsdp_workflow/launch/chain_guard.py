"""``python -m fsdp_workflow.launch.chain_guard RUN_DIR --max-steps N [--consolidates]``: submit.sh's question.

Every rendered ``submit.sh`` (and every run directory written before the scheduler
backends got a package) runs this path, so it stays; the code lives in
:mod:`fsdp_workflow.backends.slurm.live_chain`.
"""

from fsdp_workflow.backends.slurm.live_chain import main

if __name__ == "__main__":
    raise SystemExit(main())
