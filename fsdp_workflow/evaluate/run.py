"""What the evaluation stage reads of a run directory: the typed config, and the run's layout from it.

:func:`open_run` is the only place evaluate opens a file of the run it did not write
itself, so that moving it onto the typed record of a run (``core/run.py``, issue 28) is a
one-function change. Every path evaluate uses comes from the one :class:`RunDir` built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf.errors import OmegaConfBaseException

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.rundir import RunDir


class RunNotReadable(ValueError):
    """RUN_DIR holds no config.yaml this version can read: the message names the file and the fix."""


@dataclass(frozen=True)
class EvalRun:
    """A run directory as evaluation sees it.

    Attributes:
        cfg: the run's resolved config (``config.yaml``), typed.
        layout: every path of the run: the directory given, with the config's
            ``cluster.log_dir`` and ``consolidate.output_dir``.
    """

    cfg: WorkflowConfig
    layout: RunDir


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
    layout = RunDir.of(run_dir)
    try:
        cfg = load_run_config(layout.root)
    except FileNotFoundError:
        raise RunNotReadable(f"{layout.config}: not found; RUN_DIR must be a run directory written by "
                             "`python -m fsdp_workflow ... run_dir=RUN_DIR` (it holds config.yaml)") from None
    except (ValueError, OmegaConfBaseException) as err:
        raise RunNotReadable(f"{layout.config}: the config schema refuses it: {err}; fix the key named "
                             "(`python -m fsdp_workflow.replan RUN_DIR` checks a hand-edited config)") from None
    return EvalRun(cfg, RunDir.of(layout.root, cfg.cluster.log_dir, cfg.consolidate.output_dir))
