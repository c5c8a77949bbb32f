"""Data stage: records -> chat template and loss mask -> documents packed into a token cache, once.

    python -m fsdp_workflow.data.prepare RUN_DIR        # tokenise, mask, pack (the chain's first job)
    python -m fsdp_workflow.data.inspect RUN_DIR -n 3   # what will be trained, token by token

The trainer memory-maps the cache (:mod:`fsdp_workflow.data.cache`); it never
tokenises. Rests on ``config`` and ``core``; ``train`` and ``evaluate`` read it.
"""
