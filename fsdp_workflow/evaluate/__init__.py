"""Evaluation stage: one saved checkpoint -> consolidated model -> held-out perplexity.

    python -m fsdp_workflow.evaluate RUN_DIR STEP

It composes the stages below it: :func:`fsdp_workflow.consolidate.consolidate`
(in-process) and a perplexity pass over the held-out split of the prepared
token cache, read as the trainer reads it (:mod:`fsdp_workflow.train.data`). ``eval.sbatch`` runs it
for each checkpoint when ``consolidate.every_checkpoint=true``; the rendered
``post_checkpoint.sh`` submits that job (the trainer only runs the hook).
"""
