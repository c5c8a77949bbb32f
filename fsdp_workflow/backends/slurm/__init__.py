"""The Slurm backend: the one package that speaks Slurm (its commands, states and reasons).

* :mod:`backend` - :class:`~fsdp_workflow.backends.slurm.backend.SlurmBackend`, the protocol's Slurm side.
* :mod:`submit` - sbatch submission of the run directory's own scripts, cancelling what a refusal leaves.
* :mod:`queue` - squeue, scontrol -o and sacct read in one place (pure: plan and report read it).
* :mod:`reasons` - Slurm's pending reasons in words (pure: ``submit.sh`` renders from it).
* :mod:`pending` - the watch of a submitted chain's pending reasons.
* :mod:`scripts` - the batch scripts, ``submit.sh``, the per-node launcher and the sbatch command lines.
* :mod:`live_chain` - one live chain per run directory (``launch/chain_guard.py``, which ``submit.sh`` runs, asks it).
* :mod:`cluster_info`, :mod:`cluster_check` - the cluster's limits, and a chain judged against them.
* :mod:`handles` - the Python API's submitit handles.
* :mod:`status_jobs` - what ``status`` says about one job.

This file imports nothing (its pure modules are imported from below the backends stage).
"""
