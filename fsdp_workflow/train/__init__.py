"""The trainer: full fine-tuning on every rank, from a run directory and its environment.

Entry point: ``python -m fsdp_workflow.train RUN_DIR`` under torchrun, with
``RUN_DIR/launch.env`` in the environment (see :mod:`fsdp_workflow.train.loop`
and docs/training.md). Knows nothing of Slurm or containers.
"""
