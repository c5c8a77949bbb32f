"""Launch stage: run a written plan on this machine (:mod:`local`) or submit it to Slurm (:mod:`slurm`)."""
