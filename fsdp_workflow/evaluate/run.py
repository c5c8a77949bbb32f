"""What the evaluation stage reads of a run directory: the typed config, and the run's layout from it.

:func:`open_run` reads them through the run record (:mod:`fsdp_workflow.config.record`),
the one read side of a run directory; every path evaluate uses comes from its layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from fsdp_workflow.config.record import open_run as run_record
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.rundir import RunDir, parse_step


class RunNotReadable(ValueError):
    """RUN_DIR holds no config.yaml this version can read: the message names the file and the fix."""


@dataclass(frozen=True)
class EvalRun:
    """A run directory as evaluation sees it.

    Attributes:
        cfg: the run's resolved config (``config.yaml``), typed.
        layout: every path of the run: the directory given, with the config's
            ``cluster.log_dir`` and ``consolidate.output_dir``.
        saved: every step the trainer saved a checkpoint of (``saves.jsonl``), pruned ones
            included; None for a run whose trainer predates that record.
        exit_saved: the step of the checkpoint ``train_exit.json`` names (a save on a
            preemption or at the end), for a run without ``saves.jsonl``.
    """

    cfg: WorkflowConfig
    layout: RunDir
    saved: Optional[Tuple[int, ...]] = None
    exit_saved: Optional[int] = None


def open_run(run_dir: Path) -> EvalRun:
    """Read RUN_DIR's ``config.yaml`` and lay out its paths.

    The paths hang off ``run_dir`` as given (what ``eval.sbatch`` passes), not off the
    ``run_dir`` key recorded in the config.

    Args:
        run_dir: the run directory.

    Returns:
        The typed config and the run's layout.

    Raises:
        RunNotReadable: no ``config.yaml`` there, or one the schema refuses.
    """
    record = run_record(run_dir)
    cfg = record.config
    if cfg is None:
        if record.config_problem:
            raise RunNotReadable(f"{record.config_problem}; fix the key named "
                                 "(`python -m fsdp_workflow.replan RUN_DIR` checks a hand-edited config)")
        raise RunNotReadable(f"{RunDir(record.root).config}: not found; RUN_DIR must be a run directory written by "
                             "`python -m fsdp_workflow ... run_dir=RUN_DIR` (it holds config.yaml)")
    saves = record.saves
    exit_ = record.train_exit or {}
    checkpoint = exit_.get("checkpoint")
    return EvalRun(cfg, record.layout, tuple(saves.steps) if saves is not None else None,
                   parse_step(Path(checkpoint).name) if isinstance(checkpoint, str) else None)
