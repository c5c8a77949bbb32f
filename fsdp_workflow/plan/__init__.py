"""Plan stage: the launch built as data (:mod:`spec`), rendered to scripts (:mod:`render`),
written with the resolved config into the run directory (:mod:`run_dir`), and summarised
with a memory estimate (:mod:`estimate`). Nothing here imports torch.
"""
