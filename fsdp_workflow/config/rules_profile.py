"""``train.profile_steps``: a window of optimizer steps the run can reach.

The schema makes the value a list of integers (Hydra refuses ``[a,2]`` at compose
time); here it must be exactly ``[FIRST, LAST]`` with ``1 <= FIRST <= LAST <=
train.max_steps``. A window the run never reaches would be a key that changes
nothing, so it is refused (exit 2) like any other config error.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.schema import WorkflowConfig

KEY = "train.profile_steps"


def check_profile_steps(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Refuse a window that is not two steps, not in order, or not within ``train.max_steps``."""
    steps, max_steps = cfg.train.profile_steps, cfg.train.max_steps
    if steps is None:
        return
    steps = list(steps)
    example = f"{KEY}=[{min(3, max_steps)},{min(4, max_steps)}] (the 3rd and 4th steps; null: no profile)"
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        r.error(KEY, steps, "expected two optimizer steps, [FIRST,LAST], profiled from the start of FIRST to the "
                "end of LAST", example)
        return
    first, last = steps
    if first < 1:
        r.error(KEY, steps, f"steps count from 1 (the first optimizer step); {first} is never run", example)
    elif first > last:
        r.error(KEY, steps, f"FIRST ({first}) is after LAST ({last})", f"{KEY}=[{last},{first}]")
    elif last > max_steps:
        r.error(KEY, steps, f"LAST ({last}) is beyond train.max_steps={max_steps}: the run ends before it",
                f"{KEY}=[{min(first, max_steps)},{max_steps}], or a larger train.max_steps")


RULES: List[Rule] = [check_profile_steps]
