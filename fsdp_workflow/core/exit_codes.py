"""Process exit codes shared by every stage.

They are a contract between the trainer (which knows nothing of Slurm) and
the rendered job scripts (which decide what to do with each code).
"""

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error: a traceback was printed
EXIT_USAGE = 2  # bad config or arguments: a message naming the key was printed, nothing ran
EXIT_REQUEUE = 75  # EX_TEMPFAIL: preempted or out of time, a checkpoint was saved; requeue me

# Written into the run directory by the trainer when it stopped on a signal after
# saving a checkpoint; the job scripts requeue only when it is there.
REQUEUE_MARKER = ".requeue"
