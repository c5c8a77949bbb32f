"""Logging, set up once per process: rank-aware, progress that suits the terminal or the log file.

Every module logs through its own logger and never configures one::

    import logging
    log = logging.getLogger(__name__)
    log.info("resumed from %s", path)

Each entry point that is not the Hydra command (the trainer's ranks, the data
preparation, the evaluation job) calls :func:`setup_logging` once, first thing;
the Hydra command (``python -m fsdp_workflow``) gets its handlers from Hydra's
job logging (``conf/hydra/job_logging/fsdp_workflow.yaml``), which also writes
``RUN_DIR/logs/fsdp_workflow.log`` through :class:`RunLogFileHandler`.

Ranks: in a multi-process run (``WORLD_SIZE`` > 1) every line carries
``[rank R/host]``; rank 0 logs at the configured level (``log_level``, INFO by
default) and the other ranks at WARNING, so a 64-rank job log is not 64 copies of
each line. ``log_level=DEBUG`` lets every rank log at DEBUG and makes the entry
points print the full traceback of a user error (:func:`report_user_error`).

Progress: a bar (tqdm) only when stderr is a terminal; in a Slurm log (not a
terminal) the same progress becomes one log line every N steps, without the
carriage returns a bar writes (:func:`progress_bar`). Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any, List, Optional, TextIO, Union

from fsdp_workflow.core.rundir import CONFIG_FILE, PLANNER_LOG_FILE, RunDir

PACKAGE_LOGGER = "fsdp_workflow"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_HANDLER_NAME = "fsdp_workflow.console"
_active_bars: List[Any] = []  # tqdm bars on screen: log lines are written above them


def rank_and_world() -> tuple[int, int]:
    """This process's ``RANK`` and ``WORLD_SIZE`` (torchrun's variables; 0 and 1 outside a launch)."""
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def level_number(level: Union[str, int]) -> int:
    """``"INFO"`` (any case) or a number as a ``logging`` level number.

    Raises:
        ValueError: an unknown level name (the message lists the allowed ones).
    """
    if isinstance(level, int):
        return level
    value = getattr(level, "value", level)  # the schema's LogLevel enum
    number = logging.getLevelName(str(value).upper())
    if not isinstance(number, int):
        raise ValueError(f"log_level={value!r} is not a level; use one of {', '.join(LOG_LEVELS)}")
    return number


def rank_level(level: Union[str, int], rank: int) -> int:
    """The level rank ``rank`` logs at: ``level`` on rank 0, WARNING on the others unless ``level`` is DEBUG."""
    number = level_number(level)
    if rank == 0 or number <= logging.DEBUG:
        return number
    return max(number, logging.WARNING)


def line_format(rank: int, world: int) -> str:
    """The record format: time, level, ``[rank R/host]`` when there are several processes, logger, message."""
    where = f" [rank {rank}/{socket.gethostname()}]" if world > 1 else ""
    return f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s"


class _ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes above a progress bar instead of through it.

    Without a stream it writes to whatever ``sys.stderr`` is at the time, as
    ``logging.lastResort`` does (so a test capturing stderr sees the lines).
    """

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        super().__init__(stream)
        self._follow_stderr = stream is None

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr if self._follow_stderr else self._stream

    @stream.setter
    def stream(self, value: TextIO) -> None:
        self._stream = value

    def emit(self, record: logging.LogRecord) -> None:
        if not _active_bars:
            super().emit(record)
            return
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(level: Union[str, int] = "INFO", stream: Optional[TextIO] = None,
                  rank: Optional[int] = None, world: Optional[int] = None) -> logging.Logger:
    """Configure this process's logging once (calling again replaces the previous setup).

    The package's loggers (``fsdp_workflow.*``, and ``__main__``: the module run
    with ``python -m``) log at :func:`rank_level`; other
    libraries' loggers stay at WARNING (DEBUG when ``level`` is DEBUG) so that
    Accelerate's or transformers' INFO chatter does not fill the job log.

    Args:
        level: ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR`` (the config's ``log_level``).
        stream: where lines go; stderr by default (stdout stays for command output).
        rank: this process's rank; ``RANK`` from the environment by default.
        world: the number of processes; ``WORLD_SIZE`` from the environment by default.

    Returns:
        The package logger.
    """
    env_rank, env_world = rank_and_world()
    rank = env_rank if rank is None else rank
    world = env_world if world is None else world
    number = rank_level(level, rank)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    handler = _ConsoleHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(line_format(rank, world), datefmt="%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if number <= logging.DEBUG else logging.WARNING)
    return set_level(number)


def set_level(level: Union[str, int]) -> logging.Logger:
    """Set the package's loggers to ``level`` (the Hydra command calls this with ``log_level``; returns the package logger)."""
    number = level_number(level)
    # ``python -m fsdp_workflow.X`` runs X's module as ``__main__``: its logger is named so
    logging.getLogger("__main__").setLevel(number)
    package = logging.getLogger(PACKAGE_LOGGER)
    package.setLevel(number)
    return package


def debug_enabled() -> bool:
    """True when the package logs at DEBUG (``log_level=DEBUG``): user errors then show their traceback."""
    return logging.getLogger(PACKAGE_LOGGER).isEnabledFor(logging.DEBUG)


def report_user_error(log: logging.Logger, message: str, exc: BaseException) -> None:
    """Log a user error as one line, or with its full traceback under ``log_level=DEBUG``.

    The one-line form ends with how to get the traceback, the way Hydra points at
    ``HYDRA_FULL_ERROR=1``.
    """
    if debug_enabled():
        log.error(message, exc_info=exc)
    else:
        log.error("%s (set log_level=DEBUG for the full traceback)", message)


def recorded_log_level(run_dir: Union[str, "os.PathLike[str]"]) -> str:
    """The ``log_level`` a run directory's ``config.yaml`` records, read without Hydra (INFO if absent)."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    value = cfg.get("log_level") if isinstance(cfg, dict) else None
    return str(value).upper() if str(value).upper() in LOG_LEVELS else "INFO"


# ---------------------------------------------------------------- progress
def is_terminal(stream: Optional[TextIO] = None) -> bool:
    """True when ``stream`` (stderr by default) is a terminal a person watches, not a log file."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or a fake stream
        return False


def progress_bar(total: int, initial: int = 0, desc: str = "", stream: Optional[TextIO] = None) -> Optional[Any]:
    """A tqdm bar on a terminal; None elsewhere (the caller logs a progress line every N steps instead).

    Close it with :func:`close_bar` so log lines stop writing around it.
    """
    stream = stream if stream is not None else sys.stderr
    if not is_terminal(stream):
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, initial=initial, file=stream, desc=desc, dynamic_ncols=True, mininterval=1.0)
    _active_bars.append(bar)
    return bar


def close_bar(bar: Optional[Any]) -> None:
    """Close a bar from :func:`progress_bar` (None is fine)."""
    if bar is None:
        return
    if bar in _active_bars:
        _active_bars.remove(bar)
    bar.close()


# ---------------------------------------------------------------- the planner's log file
class RunLogFileHandler(logging.Handler):
    """``RUN_DIR/logs/fsdp_workflow.log`` (or ``cluster.log_dir``) for the Hydra command, opened once the run is planned.

    Hydra configures logging before the config is validated. Until ``config.yaml``
    exists in the run directory, records are held in memory: an invalid config
    (exit 2) then leaves no log file, hence no directory, behind. Once the planner
    has written the run directory (at the next record, or at exit) the held
    records are written first, and the file is appended to from then on (a
    resubmission adds to it).

    Args:
        run_dir: Hydra's run directory (``${hydra:runtime.output_dir}``, which the
            command makes equal to ``run_dir``).
        max_held: records kept before the run directory exists (the oldest are dropped).
    """

    def __init__(self, run_dir: str, max_held: int = 1000) -> None:
        super().__init__()
        self.run = RunDir.of(run_dir)
        self.max_held = max_held
        self._held: List[logging.LogRecord] = []
        self._file: Optional[logging.FileHandler] = None

    @property
    def path(self) -> Path:
        return self.run.logs / PLANNER_LOG_FILE

    def _open_when_planned(self) -> None:
        """Open the file (writing the held records first) once the run directory holds its config."""
        if self._file is None and self.run.config.is_file():
            self.run = RunDir.recorded(self.run.root)  # cluster.log_dir, as the planned config says
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = logging.FileHandler(self.path, encoding="utf-8")
            self._file.setFormatter(self.formatter)
            for held in self._held:
                self._file.emit(held)
            self._held.clear()

    def emit(self, record: logging.LogRecord) -> None:
        self._open_when_planned()
        if self._file is not None:
            self._file.emit(record)
        else:
            self._held.append(record)
            del self._held[:-self.max_held]

    def setFormatter(self, fmt: Optional[logging.Formatter]) -> None:  # noqa: N802 - logging's name
        super().setFormatter(fmt)
        if self._file is not None:
            self._file.setFormatter(fmt)

    def flush(self) -> None:
        if self._held:
            self._open_when_planned()
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """At exit (``logging.shutdown``): write what was held if the run was planned, else drop it."""
        self.flush()
        if self._file is not None:
            self._file.close()
        self._held.clear()
        super().close()
