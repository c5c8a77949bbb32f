"""Whether a run is already done, for every backend: a finished run is not run again.

A run trained to ``train.max_steps`` whose model is written is complete:
:func:`finished_message` says where the model is, and nothing is submitted or run. A model
written by an earlier, shorter run must be moved aside before a submitted chain continues
the run (a larger ``train.max_steps``); the local launcher's consolidation replaces it.
Asked by the local backend before it runs, by the Slurm backend before it submits, and by
``submit.sh`` (``python -m fsdp_workflow.launch.chain_guard``). Scheduler-free: it reads
the run directory alone.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Optional, Tuple

from fsdp_workflow.core.checkpoint_health import checkpoint_problem
from fsdp_workflow.core.commands import hydra_value, shell
from fsdp_workflow.core.rundir import RunDir

log = logging.getLogger(__name__)


def _last_step(layout: RunDir) -> Optional[int]:
    """The newest complete checkpoint's step that resume would take (``submit.sh`` counts every ``step-N``).

    A newer one that fails :func:`~fsdp_workflow.core.checkpoint_health.checkpoint_problem` (a truncated
    shard, a garbled ``.metadata``) does not make the run complete: resume sets it aside as
    ``step-N.corrupt`` and trains its steps again, so the run goes on from the newest whole one.
    """
    for step, path in reversed(layout.list_checkpoints()):
        problem = checkpoint_problem(path)
        if problem is None:
            return step
        log.warning("[fsdp_workflow] warning: checkpoint %s cannot be resumed (%s); the run is not complete: "
                    "resume sets it aside as step-%d.corrupt and trains its steps again", path, problem, step)
    return None


def _damaged_newest(layout: RunDir, last: Optional[int]) -> bool:
    """A complete-looking checkpoint newer than ``last`` exists (it failed the health check)."""
    found = layout.list_checkpoints()
    return bool(found) and (last is None or found[-1][0] > last)


def _move_aside(model: Path, last: Optional[int]) -> str:
    """The ``mv`` that sets a model aside under the step it was trained to."""
    return shlex.join(["mv", str(model), f"{model}.step-{last}"])


def _further(layout: RunDir, last: Optional[int], local: bool, model: bool) -> str:
    """How to train this run further: the override words to add, pasteable."""
    hf_model = layout.hf_model
    if last is None:
        return ("Its checkpoints were removed after the consolidation, so it cannot be continued; a longer run "
                "starts from its model in a new run_dir: "
                f"{shell(['model.init=pretrained', f'model.name_or_path={hydra_value(str(hf_model))}'])}.")
    how = ("To train further: the same command with a larger train.max_steps and "
           f"{shell([f'checkpoint.resume={hydra_value(str(layout.step_dir(last)))}'])}")
    if not model:
        return how + "."
    if local:
        return how + "; the longer run's model replaces this one once it is verified."
    return how + f", after moving this model aside ({_move_aside(hf_model, last)})."


def finished_message(layout: RunDir, max_steps: int, consolidates: bool,
                     local: bool = False) -> Tuple[Optional[str], int]:
    """Whether the run in ``layout`` is already done, or its old model would fail a continuation.

    Args:
        layout: the run directory's layout.
        max_steps: ``train.max_steps`` of the config about to run.
        consolidates: whether the chain ends with a consolidation job.
        local: for the local launcher, which runs nothing (rather than submitting nothing),
            and whose consolidation replaces a model of an earlier, shorter run.

    Returns:
        ``(None, 0)`` to go on; ``(message, 0)`` for a complete run (nothing to do);
        ``(message, 2)`` for a model of an earlier, shorter run that must be moved first
        (never for ``local``).
    """
    last = _last_step(layout)
    model = layout.hf_model
    nothing = "Nothing run." if local else "Nothing submitted."
    if _damaged_newest(layout, last):  # its steps are trained again: never complete, and the model is replaced
        return None, 0
    if consolidates and model.is_dir():
        if last is None or last >= max_steps:
            return (f"this run is complete (trained to step {last if last is not None else '?'} of "
                    f"train.max_steps={max_steps}); the model is in {model}. {nothing} "
                    f"{_further(layout, last, local, model=True)}"), 0
        if local:
            return None, 0
        return (f"{model} holds the model of an earlier, shorter run (step {last} of train.max_steps={max_steps}); "
                f"the consolidation never overwrites it. Move it aside first: {_move_aside(model, last)}; "
                "nothing submitted."), 2
    if not consolidates and last is not None and last >= max_steps:
        return (f"this run is complete (trained to step {last} of train.max_steps={max_steps}; checkpoints in "
                f"{layout.checkpoints}). {nothing} {_further(layout, last, local, model=False)}"), 0
    return None, 0


__all__ = ["finished_message"]
