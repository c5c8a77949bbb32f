"""Schedulers behind one protocol: what runs a planned chain, and what it says about its jobs.

* :mod:`base` - the :class:`~fsdp_workflow.backends.base.Backend` protocol (issues, plan,
  render, submit, states, cancel, live) and the :class:`~fsdp_workflow.backends.base.JobState` vocabulary.
* :mod:`roles` - :class:`~fsdp_workflow.backends.roles.Role`, one word per job role (and container step).
* :mod:`registry` - ``cluster.kind`` -> its backend, the one place that asks which kind a run is.
* :mod:`local` - this machine: walks ``plan.chain`` in the foreground under the run's lock.
* :mod:`slurm` - everything Slurm: submission, the queue's readers, pending reasons,
  the chain guard, the cluster's limits, the API's handles, status's job reader.

This file imports nothing: the backends' pure parts (:mod:`roles`, :mod:`base`, :mod:`slurm.queue`,
:mod:`slurm.reasons`) are imported by stages below this package (``tests/test_imports.py``).
"""
