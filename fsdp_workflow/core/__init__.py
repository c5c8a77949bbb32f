"""The bottom layer: what every stage shares, importing no stage and no torch.

* :mod:`rundir` - the run directory's contract: every name and path under
  ``RUN_DIR``, step naming and completeness, atomic writes.
* :mod:`exit_codes` - process exit codes, a contract between the trainer and the job scripts.
* :mod:`sizes` - the one size parser (``5GB``, ``2GiB``).
* :mod:`safe_pickle` - allow-list unpickling of checkpoint metadata, shared by the
  trainer's resume and the consolidator.
* :mod:`envnames` - the rules for environment variable names.
* :mod:`modeldir` - the names inside a model directory (``verification.json``, the card, the index).
* :mod:`checkpoint_health` - whether a complete-looking checkpoint is whole (resume, status, consolidator).
* :mod:`commands` - the commands printed for a user to paste.
* :mod:`config_hash` - the validated config's hash, and the check every job makes against it.
* :mod:`interrupts` - SIGTERM handled as Ctrl-C for prepare and consolidate.
* :mod:`job_exit` - why a job ended: its exit record and the line of its log that matters.
* :mod:`licences` - which files of a model directory are its licence terms.
* :mod:`lock` - one holder at a time: ``flock`` on a lock file that names its holder.
* :mod:`logs` - logging, set up once per process.
* :mod:`paths` - where an output directory may go relative to its checkpoints.

Slurm's queue and reasons live with the Slurm backend (:mod:`fsdp_workflow.backends.slurm`).

Nothing here imports another ``fsdp_workflow`` package, Hydra, torch (at import
time) or anything Slurm; every stage may import it (``tests/test_imports.py``).
"""
