"""Schedulers behind one protocol: what runs a planned chain, and what it says about its jobs.

* :mod:`base` - the :class:`~fsdp_workflow.backends.base.Backend` protocol (issues, plan,
  render, submit, states, cancel, live) and the :class:`~fsdp_workflow.backends.base.JobState` vocabulary.
* :mod:`registry` - ``cluster.kind`` -> its backend, the one place that asks which kind a run is.
* :mod:`local` - this machine: walks ``plan.chain`` in the foreground under the run's lock.
* :mod:`slurm` - everything Slurm: submission, the queue's readers, pending reasons,
  the chain guard, the cluster's limits, the API's handles, status's job reader.

This file imports nothing: the backends' pure parts (:mod:`base`, :mod:`slurm.queue`,
:mod:`slurm.reasons`) are read by the report stage and the preflight (``tests/test_imports.py``). A job's
role, which every stage names, is :class:`fsdp_workflow.core.roles.Role`.
"""
