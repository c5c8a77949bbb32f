"""The report stage: what a run did, read from its record, for people and for the Hub.

It sits above train and consolidate and reads the run directory only through the run record
(:class:`fsdp_workflow.config.record.RunRecord`):

- :mod:`.status`: ``python -m fsdp_workflow.status RUN_DIR`` (jobs, progress, curves, what to do next);
- :mod:`.card`: ``python -m fsdp_workflow.report.card MODEL_DIR --run-dir RUN_DIR``, the model card
  (``README.md``) the consolidation job writes beside the verified weights;
- :mod:`.curves`: the metrics series as plottable columns; :mod:`.plot`: the one matplotlib
  picture of them (``status --plot`` and the card's ``loss_curve.png``);
- :mod:`.run_sources`: the data sources a run trained on, with their counts (status and the card).

Nothing below this stage imports it (tests/test_imports.py).
"""
