"""The read side of a run directory: one typed record of what a run planned, did and left.

:mod:`fsdp_workflow.core.rundir` says where each file is; this module reads them, once,
into typed objects: the config (typed, through the schema loader
:func:`~fsdp_workflow.config.load.load_run_config`), provenance, the submitted jobs, the
exit records (``train_exit.json``, ``job_exits/``), the ``metrics.jsonl`` and
``evals.jsonl`` series, the checkpoints and the consolidated models. ``status``, the model
card and the resume checks ask a :class:`RunRecord`; no other module opens those files.

It lives in ``config/``, not ``core/``: the typed config comes through the schema, and
``core`` may import nothing above it. Every stage that needs the record (plan, train,
consolidate, evaluate, report) already rests on ``config``.

Every series is read by one reader, :func:`read_steps`, with one rule (issue 18): a step
logged twice (a resume redoing it) counts once, the later record replacing the earlier.
Nothing broken is skipped in silence: each file or line that cannot be read is named in
:attr:`RunRecord.problems` (``PATH[:LINE]: why``); the reader still returns what it could.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from fsdp_workflow.core.job_exit import read_record
from fsdp_workflow.core.modeldir import VERIFICATION_FILE
from fsdp_workflow.core.rundir import PathLike, RunDir

if TYPE_CHECKING:
    from fsdp_workflow.config.schema import WorkflowConfig



@dataclass(frozen=True)
class StepRecords:
    """One JSON object per step, in step order, as a series file holds them.

    Attributes:
        path: the file read.
        records: step -> its (last) record, ascending.
        problems: ``PATH:LINE: why`` for each line that holds no step record.
    """

    path: Path
    records: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Tuple[int, Dict[str, Any]]]:
        return iter(self.records.items())

    @property
    def steps(self) -> List[int]:
        return list(self.records)

    def get(self, step: int) -> Optional[Dict[str, Any]]:
        return self.records.get(step)

    def last(self) -> Optional[Dict[str, Any]]:
        """The record of the highest step (None when empty)."""
        return self.records[next(reversed(self.records))] if self.records else None

    def up_to(self, step: int) -> "StepRecords":
        """The records at or before ``step`` (a model consolidated at step N has a history up to N)."""
        return StepRecords(self.path, {s: r for s, r in self.records.items() if s <= step}, list(self.problems))


_CACHE: Dict[Tuple[str, int, int], StepRecords] = {}


def read_steps(path: PathLike) -> StepRecords:
    """Read a JSON-lines series keyed by an integer ``step``: the one reader of every series.

    A later record for a step replaces the earlier one (a resumed run redoes the steps after
    its checkpoint). A line that is not JSON, not an object, or has no integer ``step`` is
    named in ``problems``; the last line while it has no newline yet is being written, not
    broken, and is not. A missing file is an empty series.

    Cached on (path, size, mtime): ``status`` asks for the same series several times.

    Args:
        path: ``metrics.jsonl``, ``evals.jsonl`` or any file of the same shape.

    Returns:
        The records in ascending step order, and the problems found.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError:
        return StepRecords(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    by_step: Dict[int, Dict[str, Any]] = {}
    problems: List[str] = []
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as err:
        return StepRecords(path, problems=[f"{path}: unreadable: {err.strerror or err}"])
    with f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                if line.endswith("\n"):
                    problems.append(f"{path}:{num}: not JSON")
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                by_step[step] = rec
            else:
                problems.append(f"{path}:{num}: not a step record (no integer \"step\")")
    out = StepRecords(path, {s: by_step[s] for s in sorted(by_step)}, problems)
    _CACHE.clear()  # a handful of files at a time: keep only the latest read
    _CACHE[key] = out
    return out


def read_json_object(path: Path, problems: List[str]) -> Optional[Dict[str, Any]]:
    """The JSON object in ``path``; None when absent, or broken (then said in ``problems``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        problems.append(f"{path}: unreadable: {err.strerror or err}")
        return None
    try:
        obj = json.loads(text)
    except ValueError as err:
        problems.append(f"{path}: not JSON ({err})" if text.strip() else f"{path}: empty")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{path}: not a JSON object (a {type(obj).__name__})")
        return None
    return obj


@dataclass(frozen=True)
class ModelOutput:
    """A consolidated model directory and what its ``verification.json`` says.

    Attributes:
        path: the model directory (``hf_model``, ``hf_model_ema`` or ``consolidate.output_dir``).
        state: ``absent``, ``present`` (no verification.json), ``verified``, ``verification failed``,
            or ``present (unreadable verification.json)``.
        verification: verification.json's content, when readable.
    """

    path: Path
    state: str
    verification: Optional[Dict[str, Any]] = None

    @property
    def source_dirs(self) -> List[Path]:
        """The checkpoint directories the weights came from (several when averaged), as recorded."""
        sources = (self.verification or {}).get("sources")
        return [Path(s) for s in sources if isinstance(s, str)] if isinstance(sources, list) else []


class RunRecord:
    """Everything a run directory records, read lazily and at most once per file.

    Args:
        root: the run directory.
    """

    def __init__(self, root: PathLike) -> None:
        self.root = Path(os.path.abspath(root))
        self.problems: List[str] = []  # "PATH[:LINE]: why", in the order the files were read
        # files that always sit in the run directory itself: found without loading the config
        self._files = RunDir(self.root)

    # ------------------------------------------------------------ planning
    @cached_property
    def _config_and_problem(self) -> Tuple[Optional["WorkflowConfig"], str]:
        import yaml
        from omegaconf.errors import OmegaConfBaseException

        from fsdp_workflow.config.errors import ConfigError
        from fsdp_workflow.config.load import load_run_config

        path = self._files.config
        try:
            return load_run_config(path), ""
        except FileNotFoundError:
            return None, ""
        except OSError as err:
            return None, f"{path}: unreadable: {err.strerror or err}"
        except yaml.YAMLError as err:
            return None, f"{path}: not YAML ({' '.join(str(err).split())})"
        except (OmegaConfBaseException, ConfigError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return None, f"{path}: does not load as this version's config ({first})"

    @property
    def config(self) -> Optional["WorkflowConfig"]:
        """The typed config the run was planned with; None when absent or unloadable (see :attr:`config_problem`)."""
        cfg, problem = self._config_and_problem
        if problem and problem not in self.problems:
            self.problems.append(problem)
        return cfg

    @property
    def config_problem(self) -> str:
        """Why :attr:`config` is None although ``config.yaml`` exists ("" otherwise)."""
        return self._config_and_problem[1]

    @cached_property
    def layout(self) -> RunDir:
        """The run's paths, with ``cluster.log_dir`` and ``consolidate.output_dir`` as the config sets them."""
        cfg = self.config
        if cfg is None:
            return RunDir.recorded(self.root)  # what a config of another version still says about the layout
        return RunDir.of(self.root, cfg.cluster.log_dir, cfg.consolidate.output_dir)

    @cached_property
    def provenance(self) -> Optional[Dict[str, Any]]:
        """``provenance.json``: the command, git revision, code snapshot, config hash (None when absent or broken)."""
        return read_json_object(self._files.provenance, self.problems)

    @cached_property
    def jobs(self) -> List[Tuple[str, str]]:
        """``(role, job id)`` of every submitted job, oldest first (``jobs.txt``)."""
        return self._files.submitted_jobs()

    # ------------------------------------------------------------ exits
    @cached_property
    def train_exit(self) -> Optional[Dict[str, Any]]:
        """``train_exit.json``: the trainer's exit code and reason (None before a run ended)."""
        rec = read_json_object(self._files.train_exit, self.problems)
        if rec is not None:
            code = rec.get("exit_code")
            if not isinstance(code, int) or isinstance(code, bool):
                self.problems.append(f"{self._files.train_exit}: no integer exit_code (found {code!r})")
        return rec

    def train_exit_since(self, since: float) -> Optional[Dict[str, Any]]:
        """``train_exit.json`` when it was written at or after ``since`` (a ``time.time()``): this attempt's.

        None when absent, older (an earlier attempt's record) or unreadable. Read afresh on each
        call, never cached: the trainer's ranks and the local launcher ask while a rank may be
        writing it, and an attempt must not take an earlier attempt's word for its own.
        """
        path = self._files.train_exit
        try:
            if path.stat().st_mtime < since:
                return None
        except OSError:
            return None
        rec = read_json_object(path, [])
        return rec if rec is not None and isinstance(rec.get("exit_code"), int) else None

    def job_exit(self, role: str, job_id: str) -> Optional[Dict[str, Any]]:
        """The exit record a job's script wrote (``job_exits/<role>-<id>.json``), if any."""
        return read_record(self._files.job_exit(role, job_id))

    # ------------------------------------------------------------ series
    @cached_property
    def metrics(self) -> StepRecords:
        """``metrics.jsonl``: one record per optimizer step (loss, tokens/s, MFU, eval loss, time...)."""
        series = read_steps(self._files.metrics)
        self.problems += series.problems
        return series

    @cached_property
    def evals(self) -> StepRecords:
        """``evals.jsonl``: one record per evaluated checkpoint (status, perplexity, loss...)."""
        series = read_steps(self._files.evals_file)
        self.problems += series.problems
        return series

    @cached_property
    def saves(self) -> Optional[StepRecords]:
        """``saves.jsonl``: one record per checkpoint the trainer committed, pruned ones included.

        None for a run whose trainer predates the record (no file): which steps it saved is
        then known only from ``checkpoint.every_steps`` and ``train.max_steps``.
        """
        if not self._files.saves.exists():
            return None
        series = read_steps(self._files.saves)
        self.problems += series.problems
        return series

    # ------------------------------------------------------------ checkpoints and models
    @cached_property
    def checkpoints(self) -> List[Tuple[int, Path]]:
        """Complete ``step-N`` checkpoints, oldest first."""
        return self._files.list_checkpoints()

    @cached_property
    def model(self) -> ModelOutput:
        """The consolidated model (``hf_model``, or ``consolidate.output_dir``)."""
        return self._output(self.layout.hf_model)

    @cached_property
    def model_ema(self) -> ModelOutput:
        """The consolidated EMA of the weights (``train.ema_decay``), beside the model."""
        return self._output(self.layout.hf_model_ema)

    def output(self, path: PathLike) -> ModelOutput:
        """A model directory of this run named by path (the card's ``--model``)."""
        return self._output(Path(os.path.abspath(path)))

    def _output(self, path: Path) -> ModelOutput:
        if not path.is_dir():
            return ModelOutput(path, "absent")
        vpath = path / VERIFICATION_FILE
        if not vpath.is_file():
            return ModelOutput(path, "present")
        verification = read_json_object(vpath, self.problems)
        if verification is None:
            return ModelOutput(path, "present (unreadable verification.json)")
        return ModelOutput(path, "verified" if verification.get("ok") else "verification failed", verification)


def open_run(root: PathLike) -> RunRecord:
    """The record of the run directory ``root`` (nothing is read until asked for)."""
    return RunRecord(root)


__all__ = ["ModelOutput", "RunRecord", "StepRecords", "open_run", "read_json_object",
           "read_steps"]
