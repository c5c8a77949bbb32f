"""The bottom layer: what every stage shares, importing no stage and no torch.

* :mod:`rundir` - the run directory's contract: every name and path under
  ``RUN_DIR``, step naming and completeness, atomic writes.
* :mod:`exit_codes` - process exit codes, a contract between the trainer and the job scripts.
* :mod:`sizes` - the one size parser (``5GB``, ``2GiB``).
* :mod:`safe_pickle` - allow-list unpickling of checkpoint metadata, shared by the
  trainer's resume and the consolidator.
* :mod:`envnames` - the rules for environment variable names.
* :mod:`modeldir` - the names inside a model directory (``verification.json``, the card, the index).
* :mod:`slurm_queue` - Slurm's queue read in one place: job states, ``squeue``, ``scontrol -o``,
  ``sacct`` (here until the scheduler backends get a package: plan and report read it too).

Nothing here imports another ``fsdp_workflow`` package, Hydra, torch (at import
time) or anything Slurm; every stage may import it (``tests/test_imports.py``).
"""
