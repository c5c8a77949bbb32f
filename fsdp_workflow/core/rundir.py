"""The run directory's contract: every name under ``RUN_DIR``, in one module.

Every stage meets the others in the run directory: the planner writes the
config and the scripts, the trainer writes checkpoints and metrics, the
consolidator reads the checkpoints and writes the model, ``status`` reads it
all. They all ask this module for paths, so a layout change is a one-file
change (``tests/test_imports.py`` fails on a path literal anywhere else)::

    RUN_DIR/
      config.yaml  launch.env  provenance.json  jobs.txt      what was planned and submitted
      code/fsdp_workflow/                                     the package as submitted: every job imports it first
      prepare.sbatch  train.sbatch  train_node.sh  consolidate.sbatch  eval.sbatch  submit.sh
      post_checkpoint.sh                                      run by rank 0 after each checkpoint (if planned)
      logs/                                                   job logs (or cluster.log_dir); fsdp_workflow.log: the command's own
      trackers/                                               experiment trackers' local files (train.report_to)
      checkpoints/step-N/                                     complete checkpoints
      checkpoints/step-N.tmp/  step-N.deleting/               being written / being pruned: never a checkpoint
      checkpoints/step-N.corrupt/                             failed verification at resume: set aside, never deleted
      heartbeats/rank-R.json                                  each rank's last sign of life (names a hung rank)
      hf_assets/                                              config.json, tokenizer (written once by the trainer)
      hf_model/                                               the consolidated model (or consolidate.output_dir)
      hf_model_ema/                                           its EMA (train.ema_decay; beside output_dir as <name>_ema)
      evals/pending/step-N/  evals/step-N/  evals.jsonl       per-checkpoint evaluation
      data.json  data_cache/<key>/                            the tokenised, packed data (prepare step)
      metrics.jsonl  train_exit.json  .requeue  .cache/
      profile/rankR.trace.json  profile/rankR.key_averages.txt   train.profile_steps: each rank's Chrome trace and op table
      saves.jsonl                                             one line per checkpoint the trainer committed ({"step": N})
      job_exits/<role>-<id>.json                              every job's exit record (code, cause), written by its script
      .lock                                                   one holder at a time (core/lock.py): planner, launcher, rank 0
      .preflight/<job id>.<restart>/node-I.json               each node's facts for the training job's preflight (kept on failure)

A sweep (``python -m fsdp_workflow -m ...``) puts one run directory per point in
its sweep directory, beside ``sweep.json``, the index of the points.

A checkpoint is complete when DCP's ``.metadata`` (written last, by the
coordinator) or DeepSpeed's ``latest`` tag file is present; the trainer
writes into ``step-N.tmp`` and renames it, so a crash never leaves a
``step-N`` that looks complete. Nothing here imports torch, Hydra or Slurm.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

# ---------------------------------------------------------------- names
CONFIG_FILE = "config.yaml"
LAUNCH_ENV_FILE = "launch.env"
PROVENANCE_FILE = "provenance.json"
JOBS_FILE = "jobs.txt"  # "<role> <job id>" lines appended at each submission
CODE_DIR = "code"  # the package as submitted (cluster.code_snapshot): first on every job's PYTHONPATH
SWEEP_FILE = "sweep.json"  # in a sweep directory: each point's overrides, run dir and job ids
METRICS_FILE = "metrics.jsonl"
PROFILE_DIR = "profile"  # train.profile_steps: rank<R>.trace.json and rank<R>.key_averages.txt
TRAIN_EXIT_FILE = "train_exit.json"  # the trainer's exit code and reason (torchrun reports any failure as 1)
EVALS_FILE = "evals.jsonl"  # one JSON line per evaluated checkpoint
SAVES_FILE = "saves.jsonl"  # one JSON line per checkpoint the trainer committed, pruned ones included
REQUEUE_MARKER = ".requeue"  # written by the trainer when it checkpointed on a signal; the job scripts requeue on it
CACHE_DIR = ".cache"
RUN_LOCK_FILE = ".lock"  # flock'd by the planner while it writes, the local launcher and rank 0 while training
DATA_CACHE_DIR = "data_cache"  # tokenised, packed data (unless data.cache_dir names a shared one)
DATA_POINTER_FILE = "data.json"  # which cache this run trains on, written by the prepare step
JOB_EXITS_DIR = "job_exits"  # <role>-<job id>.json: each job's exit code and cause, written by its batch script
PREFLIGHT_DIR = ".preflight"  # <job id>.<restart>/node-I.json: each node's facts (fsdp_workflow.preflight)
HF_MODEL_STAGING_GLOB = ".*.tmp-*"  # beside the model: a consolidation's staging directory (.hf_model.tmp-<pid>)

PREPARE_SBATCH = "prepare.sbatch"
TRAIN_SBATCH = "train.sbatch"
TRAIN_NODE_SCRIPT = "train_node.sh"
CONSOLIDATE_SBATCH = "consolidate.sbatch"
EVAL_SBATCH = "eval.sbatch"
SUBMIT_SCRIPT = "submit.sh"
POST_CHECKPOINT_HOOK = "post_checkpoint.sh"  # bash post_checkpoint.sh STEP, after step-STEP is committed

LOG_DIR = "logs"
PLANNER_LOG_FILE = "fsdp_workflow.log"  # RUN_DIR/logs/: what `python -m fsdp_workflow` logged (Hydra's job logging)
TRACKERS_DIR = "trackers"  # experiment trackers' local stores, one folder per tracker
TRACKER_NAMES = ("tensorboard", "mlflow", "wandb", "trackio")  # train.report_to values (besides none)
TRACKER_IDS_FILE = "run_ids.json"  # trackers/: the MLflow / W&B run ids, so a resume or an eval job logs to the same run
CHECKPOINTS_DIR = "checkpoints"
HF_ASSETS_DIR = "hf_assets"
HF_MODEL_DIR = "hf_model"
# A checkpoint's key roots that hold weights: the model, and its EMA when train.ema_decay is set.
MODEL_KEY = "model"
EMA_KEY = "ema"
EMA_SUFFIX = "_ema"  # the EMA's model sits beside the model: hf_model_ema, or <output_dir>_ema
EVALS_DIR = "evals"
PENDING_EVALS_DIR = "pending"

STEP_PREFIX = "step-"
STEP_RE = re.compile(r"^step-(\d+)$")
TMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
QUARANTINE_SUFFIX = ".corrupt"  # a step-N that failed verification, renamed aside (never deleted)
HEARTBEATS_DIR = "heartbeats"
DCP_METADATA = ".metadata"  # written last by DCP's coordinator
DEEPSPEED_LATEST = "latest"  # written last by DeepSpeed's save_checkpoint


# ---------------------------------------------------------------- steps
def step_name(step: int) -> str:
    """``step-N``: the directory name of the checkpoint after optimizer step N."""
    return f"{STEP_PREFIX}{int(step)}"


def parse_step(name: str) -> Optional[int]:
    """N for ``step-N``; None for anything else (``step-N.tmp``, ``step-N.deleting``...)."""
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_complete_checkpoint(path: Path) -> bool:
    """A DCP checkpoint has ``.metadata``; a DeepSpeed one has its ``latest`` tag file."""
    return (path / DCP_METADATA).is_file() or (path / DEEPSPEED_LATEST).is_file()


def list_checkpoints(checkpoints_dir: Path) -> List[Tuple[int, Path]]:
    """Complete ``step-N`` checkpoints under ``checkpoints_dir``, oldest first."""
    out: List[Tuple[int, Path]] = []
    if checkpoints_dir.is_dir():
        for p in checkpoints_dir.iterdir():
            step = parse_step(p.name)
            if step is not None and p.is_dir() and is_complete_checkpoint(p):
                out.append((step, p))
    return sorted(out)


# ---------------------------------------------------------------- atomic writes
def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON with a final newline."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_json_line(path: Path, obj: Any) -> None:
    """Append ``obj`` as one JSON line to ``path`` and make it durable (a series such as :data:`SAVES_FILE`)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_sweep_index(sweep_dir: Path) -> dict:
    """A sweep directory's ``sweep.json`` (``{"sweep_dir", "points": [...]}``); an empty index when absent or unreadable."""
    try:
        index = json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict) or not isinstance(index.get("points"), list):
        index = {"points": []}
    index["sweep_dir"] = str(sweep_dir)
    return index


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the layout
@dataclass(frozen=True)
class RunDir:
    """Every path of one run directory.

    Args:
        root: the run directory (``~`` expanded, made absolute, as for the two below).
        log_dir: ``cluster.log_dir`` when set; job logs go there instead of ``RUN_DIR/logs``.
        output_dir: ``consolidate.output_dir`` when set; the model goes there instead of ``RUN_DIR/hf_model``.
    """

    root: Path
    log_dir: Optional[Path] = None
    output_dir: Optional[Path] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(os.path.abspath(os.path.expanduser(str(self.root)))))
        for name in ("log_dir", "output_dir"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(os.path.abspath(os.path.expanduser(str(value)))))

    @classmethod
    def of(cls, root: PathLike, log_dir: Optional[PathLike] = None, output_dir: Optional[PathLike] = None) -> "RunDir":
        """The layout for ``root`` with optional ``cluster.log_dir`` / ``consolidate.output_dir``."""
        return cls(Path(root), Path(log_dir) if log_dir else None, Path(output_dir) if output_dir else None)

    @classmethod
    def recorded(cls, root: PathLike) -> "RunDir":
        """The layout a written run directory records in its ``config.yaml`` (read without Hydra).

        A missing or unreadable ``config.yaml`` gives the default layout.
        """
        import yaml

        try:
            cfg = yaml.safe_load((Path(root) / CONFIG_FILE).read_text()) or {}
        except (OSError, yaml.YAMLError):
            cfg = {}
        if not isinstance(cfg, dict):
            cfg = {}
        cluster = cfg.get("cluster") if isinstance(cfg.get("cluster"), dict) else {}
        cons = cfg.get("consolidate") if isinstance(cfg.get("consolidate"), dict) else {}
        return cls.of(root, cluster.get("log_dir") or None, cons.get("output_dir") or None)

    @property
    def lock(self) -> Path:
        """The run's lock file (:mod:`fsdp_workflow.core.lock`): one command or trainer at a time."""
        return self.root / RUN_LOCK_FILE

    # files written at planning time
    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def launch_env(self) -> Path:
        return self.root / LAUNCH_ENV_FILE

    @property
    def provenance(self) -> Path:
        return self.root / PROVENANCE_FILE

    @property
    def jobs(self) -> Path:
        return self.root / JOBS_FILE

    @property
    def code(self) -> Path:
        """The code snapshot's import root (``cluster.code_snapshot``): ``code/fsdp_workflow`` sits in it."""
        return self.root / CODE_DIR

    def submitted_jobs(self) -> List[Tuple[str, str]]:
        """``(role, job id)`` pairs of ``jobs.txt``, oldest first (none before a submission)."""
        if not self.jobs.is_file():
            return []
        return [(parts[0], parts[1]) for parts in map(str.split, self.jobs.read_text().splitlines()) if len(parts) >= 2]

    @property
    def job_exits(self) -> Path:
        """``job_exits/``: one record per job that ended (:mod:`fsdp_workflow.core.job_exit`)."""
        return self.root / JOB_EXITS_DIR

    def job_exit(self, role: str, job_id: str) -> Path:
        """The exit record of job ``job_id`` (an evaluation, ``eval-step-N``, records as ``eval``)."""
        base = role.split("-")[0] if role.startswith("eval") else role
        return self.job_exits / f"{base}-{job_id}.json"

    def preflight(self, job_id: str, restart: int = 0) -> Path:
        """Where the nodes of one run of training job ``job_id`` leave their preflight facts (``node-I.json``)."""
        return self.root / PREFLIGHT_DIR / f"{job_id}.{int(restart)}"

    def script(self, name: str) -> Path:
        """A rendered script (``train.sbatch``, ``submit.sh``...) by file name."""
        return self.root / name

    @property
    def post_checkpoint_hook(self) -> Path:
        return self.root / POST_CHECKPOINT_HOOK

    # logs
    @property
    def logs(self) -> Path:
        return self.log_dir if self.log_dir is not None else self.root / LOG_DIR

    def log_pattern(self, role: str) -> Path:
        """Slurm's ``--output`` for a job of ``role`` (``%j``: the job id)."""
        return self.logs / f"{role}-%j.out"

    def log_file(self, role: str, job_id: str) -> Path:
        """The log of job ``job_id``; an evaluation (``eval-step-N``) logs as ``eval``."""
        base = role.split("-")[0] if role.startswith("eval") else role
        return self.logs / f"{base}-{job_id}.out"

    # written by the trainer
    @property
    def trackers(self) -> Path:
        """``trackers/``: TensorBoard event files, the MLflow file store, W&B's and Trackio's offline files."""
        return self.root / TRACKERS_DIR

    def tracker_dir(self, name: str) -> Path:
        """One tracker's local files (``tensorboard``, ``mlflow``, ``wandb``, ``trackio``)."""
        if name not in TRACKER_NAMES:
            raise ValueError(f"unknown tracker {name!r}; one of {', '.join(TRACKER_NAMES)}")
        return self.trackers / name

    @property
    def tracker_ids(self) -> Path:
        return self.trackers / TRACKER_IDS_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def train_exit(self) -> Path:
        return self.root / TRAIN_EXIT_FILE

    @property
    def profile(self) -> Path:
        """``profile/``: what ``train.profile_steps`` recorded."""
        return self.root / PROFILE_DIR

    def profile_trace(self, rank: int) -> Path:
        """Rank ``rank``'s Chrome trace (open it in Perfetto or chrome://tracing)."""
        return self.profile / f"rank{int(rank)}.trace.json"

    def profile_table(self, rank: int) -> Path:
        """Rank ``rank``'s ``key_averages`` table, sorted by device time."""
        return self.profile / f"rank{int(rank)}.key_averages.txt"

    @property
    def saves(self) -> Path:
        """``saves.jsonl``: every step the trainer saved a checkpoint of, written at each commit."""
        return self.root / SAVES_FILE

    @property
    def requeue_marker(self) -> Path:
        return self.root / REQUEUE_MARKER

    @property
    def cache(self) -> Path:
        return self.root / CACHE_DIR

    @property
    def data_cache(self) -> Path:
        """The default root of the token caches (``data.cache_dir`` may name a shared one instead)."""
        return self.root / DATA_CACHE_DIR

    @property
    def data_pointer(self) -> Path:
        """``data.json``: the cache directory this run trains on, written by the prepare step."""
        return self.root / DATA_POINTER_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    def step_tmp(self, step: int) -> Path:
        """Where a save of ``step`` is written before its rename to :meth:`step_dir`."""
        return self.checkpoints / (step_name(step) + TMP_SUFFIX)

    def list_checkpoints(self) -> List[Tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        return list_checkpoints(self.checkpoints)

    def quarantine_path(self, step: int) -> Path:
        """A free ``step-N.corrupt[-K]`` name to set a checkpoint that failed verification aside."""
        base = self.checkpoints / (step_name(step) + QUARANTINE_SUFFIX)
        path, k = base, 1
        while path.exists():
            k += 1
            path = base.with_name(f"{base.name}-{k}")
        return path

    def quarantined(self) -> List[Path]:
        """Checkpoints set aside by :meth:`quarantine_path` renames, by name."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir()
                      if QUARANTINE_SUFFIX in p.name and p.name.startswith(STEP_PREFIX))

    @property
    def heartbeats(self) -> Path:
        """One small JSON file per rank, rewritten every few seconds while it trains."""
        return self.root / HEARTBEATS_DIR

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"rank-{int(rank)}.json"

    def latest_checkpoint(self) -> Optional[Tuple[int, Path]]:
        found = self.list_checkpoints()
        return found[-1] if found else None

    @property
    def hf_assets(self) -> Path:
        return self.root / HF_ASSETS_DIR

    # written by the consolidator and the evaluations
    @property
    def hf_model(self) -> Path:
        return self.output_dir if self.output_dir is not None else self.root / HF_MODEL_DIR

    @property
    def hf_model_ema(self) -> Path:
        """The consolidated EMA of the weights (``train.ema_decay``), beside :attr:`hf_model`."""
        return self.hf_model.with_name(self.hf_model.name + EMA_SUFFIX)

    def eval_model_ema(self, step: int) -> Path:
        """Where an evaluation consolidates ``step-N``'s EMA (removed after it is measured)."""
        return self.evals / (step_name(step) + EMA_SUFFIX)

    @property
    def evals(self) -> Path:
        return self.root / EVALS_DIR

    @property
    def evals_file(self) -> Path:
        return self.root / EVALS_FILE

    @property
    def pending_evals(self) -> Path:
        """Where checkpoints wait, hard-linked, for their evaluation job."""
        return self.evals / PENDING_EVALS_DIR

    def eval_snapshot(self, step: int) -> Path:
        """The hard-linked copy of ``step-N`` an evaluation job reads (immune to pruning)."""
        return self.pending_evals / step_name(step)

    def eval_model(self, step: int) -> Path:
        """Where an evaluation consolidates ``step-N`` (removed after it is measured)."""
        return self.evals / step_name(step)

