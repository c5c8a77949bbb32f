"""Evaluation stage: one saved checkpoint -> consolidated model -> held-out perplexity.

    python -m fsdp_workflow.evaluate RUN_DIR STEP

It composes the stages below it: :func:`fsdp_workflow.consolidate.consolidate`
(in-process) and a perplexity pass over the held-out split of the prepared token cache,
read as the trainer reads it (:mod:`fsdp_workflow.train.heldout`, the only part of the
trainer it uses besides the trackers' :func:`~fsdp_workflow.train.trackers.log_checkpoint_eval`).
``eval.sbatch`` runs it for each checkpoint when ``consolidate.every_checkpoint=true``;
the rendered ``post_checkpoint.sh`` submits that job (the trainer only runs the hook).

* :mod:`.run`: the run directory as evaluation reads it (config and layout, one function);
* :mod:`.per_checkpoint`: consolidate a checkpoint (and its EMA), measure, clean up;
* :mod:`.perplexity`: a consolidated model's loss on the held-out samples;
* :mod:`.eval_record`: the ``evals.jsonl`` line, and the experiment trackers;
* :mod:`.__main__`: the command line.

See docs/evaluation.md.
"""
