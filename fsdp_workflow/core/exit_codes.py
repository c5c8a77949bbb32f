"""Process exit codes shared by every stage.

They are a contract between the trainer (which knows nothing of Slurm) and
the rendered job scripts (which decide what to do with each code).
"""

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error: a traceback was printed
EXIT_USAGE = 2  # bad config or arguments: a message naming the key was printed, nothing ran
EXIT_REQUEUE = 75  # EX_TEMPFAIL: preempted or out of time, a checkpoint was saved; requeue me
# torchrun reports any failed worker as 1, so the job scripts requeue on the run directory's
# marker (fsdp_workflow.core.rundir.REQUEUE_MARKER) rather than on this code alone.
