"""Experiment trackers (``train.report_to``) through Accelerate's tracker integration.

The trainer builds ``Accelerator(log_with=tracker_objects(...), project_config=...)``,
then :func:`start` calls ``accelerator.init_trackers`` with the resolved config,
flattened, as hyperparameters, and every line of ``metrics.jsonl`` goes to
``accelerator.log`` (:func:`metrics_values`). Accelerate's trackers act on the
main process only, so rank 0 alone writes. Every tracker keeps its files under
``RUN_DIR/trackers/`` unless its own environment variable points elsewhere:

- ``tensorboard``: event files in ``trackers/tensorboard/``;
- ``mlflow``: a file store ``file://RUN_DIR/trackers/mlflow`` unless
  ``MLFLOW_TRACKING_URI`` names a server (MLflow 3 refuses a file store unless
  ``MLFLOW_ALLOW_FILE_STORE=true``, which is set for it);
- ``wandb``: ``trackers/wandb/``; ``WANDB_MODE=offline`` runs without a network
  (``wandb sync`` uploads later);
- ``trackio``: ``TRACKIO_DIR`` defaults to ``trackers/trackio/``.

A step is recorded once after any resume (the rule of :mod:`.metrics`): a run
starting at step N tells TensorBoard to purge the events past N
(:func:`forget_steps_after`, what ``SummaryWriter(purge_step=N + 1)`` writes),
so the steps redone after a crash replace the ones logged before it. MLflow
keeps every value logged at a step, so a step redone after a crash shows two
points at that step in its history (its "latest" value is the redone one); W&B
refuses a step lower than one it has seen and drops the redone points with a
warning. ``metrics.jsonl`` is the record that holds each step exactly once.

The MLflow and W&B run ids are kept in ``trackers/run_ids.json``: a resumed job
and the per-checkpoint evaluation jobs (:func:`log_checkpoint_eval`) log to the
same run. A tracker whose package is missing at run time (planning warned of it
for a Slurm run) is dropped with a warning; training goes on.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Callable, Dict, List, Mapping, Optional

from fsdp_workflow.config.rules_trackers import missing_tracker_packages
from fsdp_workflow.config.schema import Tracker, WorkflowConfig
from fsdp_workflow.core.rundir import RunDir, atomic_write_json

log = logging.getLogger(__name__)

# metrics.jsonl fields that are not series: the wall time (trackers stamp their own) and the step (the x axis)
NOT_LOGGED = ("time", "step")
CHECKPOINT_EVAL_PREFIX = "checkpoint_eval/"  # evals.jsonl values, logged at the checkpoint's step


def requested(cfg: WorkflowConfig) -> List[Tracker]:
    """The trackers ``train.report_to`` asks for, in order, without ``none`` and repeats."""
    return [t for t in dict.fromkeys(cfg.train.report_to) if t != Tracker.none]


def available(cfg: WorkflowConfig, warn: bool = True) -> List[Tracker]:
    """:func:`requested` less those whose package is missing here (each named in a warning if ``warn``)."""
    missing = dict(missing_tracker_packages(requested(cfg)))
    for tracker, package in missing.items() if warn else ():
        log.warning("train.report_to: %s is not installed in this environment (pip install %s); "
                    "training goes on without the %s tracker", package, package, tracker.value)
    return [t for t in requested(cfg) if t not in missing]


def flat_config(cfg: WorkflowConfig) -> Dict[str, Any]:
    """The resolved config as ``{"train.max_steps": 10, ...}``: scalars as they are, the rest as JSON text.

    Every tracker takes a flat mapping of str/int/float/bool values; enums become
    their value, None becomes ``"null"`` and lists and mappings their JSON, so no
    key is dropped.
    """
    out: Dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                walk(f"{prefix}{f.name}.", value)
            else:
                out[prefix + f.name] = _scalar(value)

    walk("", cfg)
    return out


def _scalar(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if value is None:
        return "null"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True, default=lambda v: v.value if isinstance(v, Enum) else str(v))
    return value


def _ids(run: RunDir) -> Dict[str, str]:
    try:
        data = json.loads(run.tracker_ids.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _prepare_environment(run: RunDir, trackers: List[Tracker]) -> None:
    """Point each tracker's local store under ``RUN_DIR/trackers/`` unless the user's variables say otherwise."""
    if Tracker.mlflow in trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = run.tracker_dir("mlflow").as_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if Tracker.trackio in trackers:
        os.environ.setdefault("TRACKIO_DIR", str(run.tracker_dir("trackio")))


def tracker_objects(cfg: WorkflowConfig, run: RunDir, trackers: List[Tracker], is_main: bool) -> List[Any]:
    """Accelerate tracker objects for ``Accelerator(log_with=...)``, placed under ``RUN_DIR/trackers/``.

    Args:
        cfg: the run's config (``name`` names the experiment / project).
        run: the run directory.
        trackers: the trackers to build (:func:`available`).
        is_main: this process is rank 0 (it alone creates directories and run ids).
    """
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, TrackioTracker, WandBTracker

    ids = _ids(run)
    out: List[Any] = []
    if is_main and trackers:
        _prepare_environment(run, trackers)
        for t in trackers:
            run.tracker_dir(t.value).mkdir(parents=True, exist_ok=True)
    for t in trackers:
        if t == Tracker.tensorboard:
            # Accelerate writes into logging_dir/run_name: here trackers/tensorboard/
            out.append(TensorBoardTracker("tensorboard", run.trackers))
        elif t == Tracker.mlflow:
            out.append(MLflowTracker(experiment_name=cfg.name, logging_dir=run.tracker_dir("mlflow").as_uri(),
                                     run_id=ids.get("mlflow"), run_name=run.root.name))
        elif t == Tracker.wandb:
            wandb_id = ids.get("wandb") or uuid.uuid4().hex[:12]
            out.append(WandBTracker(cfg.name, dir=str(run.tracker_dir("wandb")), id=wandb_id, resume="allow",
                                    name=run.root.name))
        elif t == Tracker.trackio:
            out.append(TrackioTracker(cfg.name, name=run.root.name, resume="allow"))
    return out


def accelerator_kwargs(cfg: WorkflowConfig, run: RunDir, is_main: bool) -> Dict[str, Any]:
    """``Accelerator(**these)``: ``log_with`` and a project under the run directory; ``{}`` without trackers."""
    trackers = available(cfg, warn=is_main)
    if not trackers:
        return {}
    from accelerate.utils import ProjectConfiguration

    return {"log_with": tracker_objects(cfg, run, trackers, is_main),
            "project_config": ProjectConfiguration(project_dir=str(run.root), logging_dir=str(run.trackers))}


def record_run_ids(run: RunDir, accelerator: Any) -> None:
    """Rank 0: keep the MLflow and W&B run ids, so later jobs log to the same runs."""
    ids = _ids(run)
    for tracker in accelerator.trackers:
        if tracker.name == "mlflow":
            ids["mlflow"] = tracker.tracker.info.run_id
        elif tracker.name == "wandb":
            ids["wandb"] = tracker.tracker.id
    if ids and ids != _ids(run):
        atomic_write_json(run.tracker_ids, ids)


def start(accelerator: Any, cfg: WorkflowConfig, run: RunDir) -> None:
    """``init_trackers`` with the flattened config as hyperparameters (rank 0; a no-op without trackers)."""
    if not accelerator.log_with:
        return
    accelerator.init_trackers(cfg.name, config=flat_config(cfg))
    if accelerator.is_main_process:
        record_run_ids(run, accelerator)
        log.info("experiment trackers: %s, under %s", ", ".join(t.name for t in accelerator.trackers), run.trackers)


def metrics_values(record: Mapping[str, Any]) -> Dict[str, float]:
    """The numeric fields of one ``metrics.jsonl`` line, as logged (all but ``time`` and ``step``)."""
    return {k: v for k, v in record.items()
            if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool)}


def metrics_hook(accelerator: Any) -> Optional[Callable[[Mapping[str, Any]], None]]:
    """A :class:`~fsdp_workflow.train.metrics.MetricsLogger` ``on_record`` callback: each line to ``accelerator.log``.

    None where this process holds no tracker (no ``report_to``, or not rank 0).
    """
    if not accelerator.trackers:
        return None

    def on_record(record: Mapping[str, Any]) -> None:
        accelerator.log(metrics_values(record), step=int(record["step"]))
    return on_record


def forget_steps_after(accelerator: Any, step: int) -> None:
    """Rank 0: make TensorBoard discard events logged past ``step`` by an earlier attempt of this run.

    The events ``SummaryWriter(purge_step=step + 1)`` would write at start-up; the
    writer exists before the checkpoint's step is known, so they are written here.
    """
    for tracker in accelerator.trackers:
        if tracker.name != "tensorboard":
            continue
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        writer = tracker.writer._get_file_writer()  # SummaryWriter's own FileWriter
        writer.add_event(Event(step=step + 1, file_version="brain.Event:2"))
        writer.add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))


def finish(accelerator: Any) -> None:
    """Flush and close the trackers (rank 0 holds them); the process group stays (unlike ``end_training``)."""
    for tracker in accelerator.trackers:
        tracker.finish()


def log_checkpoint_eval(cfg: WorkflowConfig, run: RunDir, record: Mapping[str, Any]) -> Optional[List[str]]:
    """Log one ``evals.jsonl`` line to the run's trackers, at the checkpoint's step.

    Called by the evaluation job (one process), after the line is appended. It
    uses the same Accelerate trackers as the trainer: TensorBoard writes another
    event file into the same folder, MLflow and W&B resume the training's run
    from ``trackers/run_ids.json``. Only ``status=ok`` lines carry values.

    Returns:
        The names of the trackers logged to (None when there were none).
    """
    values = {CHECKPOINT_EVAL_PREFIX + k: v for k, v in metrics_values(record).items()
              if k not in ("seconds",)}
    trackers = available(cfg)
    if not trackers or record.get("status") != "ok" or not values:
        return None
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with=tracker_objects(cfg, run, trackers, is_main=True))
    accelerator.init_trackers(cfg.name)
    accelerator.log(values, step=int(record["step"]))
    finish(accelerator)
    return [t.value for t in trackers]
