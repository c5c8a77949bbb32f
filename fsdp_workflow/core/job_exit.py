"""Why a job of the chain ended: its exit record, and the line of its log that matters.

One mechanism for every job (prepare, train, consolidate, eval): the batch script's
``EXIT`` trap writes ``RUN_DIR/job_exits/<role>-<job id>.json`` (:func:`fsdp_workflow.backends.slurm.scripts.exit_record_lines`)
with the exit code, the restart count and a cause when the script knows it (a config
that changed since planning). The record is written by the shell, so it exists even
when Python could not start (a missing module, exit 127); it outlives slurmctld's
memory of the job, and needs no accounting.

The words come from the job's log: :func:`explain` reads its last lines and picks the
first one that says what went wrong (an exception, ``command not found``, a bad record
at ``file:line``), and a fix where the cause is known. A job that died before its
script could write anything (a signal, a node failure) is explained from Slurm's
exit code and the log alone.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

from fsdp_workflow.core.config_hash import CONFIG_CHANGED_CAUSE, changed_message
from fsdp_workflow.core.exit_codes import MEANINGS

TAIL_BYTES = 64 * 1024  # the end of a log is where a failure is told
# A line that says what went wrong, most telling first.
_ERROR_LINE = [
    re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)\b.*"),  # a traceback's last line
    re.compile(r".*\b(command not found|not found|No such file or directory)\b.*"),
    re.compile(r".*\S+\.\w+:\d+:.*"),  # a bad input named by file:line (data preparation)
    re.compile(r".*\b(error|Error|ERROR|fatal|FATAL|refused|failed|Killed|killed)\b.*"),
]
_NOISE = re.compile(r"^(srun: |slurmstepd: .*(CANCELLED|DUE TO TIME LIMIT))")


@dataclass
class Explained:
    """Why a job ended, for ``status``."""

    exit_code: Optional[int]  # the job's exit code (None: it recorded none)
    reason: str  # in words
    line: str = ""  # the line of the log that matters
    fix: str = ""  # what to do, where it is known
    source: str = ""  # "record" (job_exits/...json), "slurm" (its exit code), "log"

    def to_dict(self) -> dict:
        return asdict(self)


def read_record(path: Path) -> Optional[dict]:
    """The exit record at ``path``; None when absent or not a JSON object."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def log_tail(path: Optional[Path], max_bytes: int = TAIL_BYTES) -> List[str]:
    """The last lines of a log (at most ``max_bytes``); [] when there is none."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if size > max_bytes else lines  # the first line may be cut


def first_error_line(lines: List[str]) -> str:
    """The line that says what went wrong: an exception's line first, else the first error-looking line."""
    clean = [line.strip() for line in lines if line.strip() and not _NOISE.match(line.strip())]
    for pattern in _ERROR_LINE:
        for line in clean:
            if pattern.match(line):
                return line[:400]
    return ""


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# (pattern on the line that matters, reason, fix); the first that matches wins.
_KNOWN = [
    (re.compile(r"No module named '?([\w.]+)"),
     "Python could not import {0}: the job ran an interpreter without the project's environment",
     "plan again from the environment that has it (the scripts record the planning interpreter), or set "
     "cluster.env_script / cluster.modules to load it"),
    (re.compile(r"(\S+): (?:command )?not found"),
     "{0} was not found on the node's PATH",
     "load it in the job: cluster.modules or cluster.env_script, then plan and submit again"),
    (re.compile(r"(\S+): output path already exists"),
     "the output {0} exists already (a consolidation never overwrites a model)",
     "move it aside (mv {0} {0}.old) or set consolidate.output_dir, then submit again"),
    (re.compile(r"(\S+\.\w+:\d+):"),
     "bad input at {0}",
     "fix that line (or drop the record), then submit again"),
]


def _known(line: str) -> tuple:
    for pattern, reason, fix in _KNOWN:
        m = pattern.search(line)
        if m:
            return reason.format(m.group(1)), fix.format(m.group(1))
    return "", ""


def explain(record: Optional[dict], slurm_exit: str, log: Optional[Path], run_dir: Path) -> Optional[Explained]:
    """Why a job failed, from its exit record, Slurm's ``ExitCode`` (``rc:signal``) and its log.

    Args:
        record: the job's exit record (:func:`read_record`), or None.
        slurm_exit: Slurm's ``ExitCode`` (``"1:0"``, ``"0:9"``), or "".
        log: the job's log file, or None.
        run_dir: the run directory (for the commands in a fix).

    Returns:
        None when nothing says it failed (exit 0 everywhere); else the explanation.
    """
    code: Optional[int] = None
    sig = 0
    source = ""
    if record is not None and isinstance(record.get("exit_code"), int):
        code, source = record["exit_code"], "record"
    elif slurm_exit:
        rc, _, s = slurm_exit.partition(":")
        code = int(rc) if rc.isdigit() else None
        sig = int(s) if s.isdigit() else 0
        source = "slurm"
    if record is not None and record.get("cause") == CONFIG_CHANGED_CAUSE:
        return Explained(code, "config.yaml changed since planning", changed_message(run_dir).split(". ", 1)[0],
                         changed_message(run_dir).split(". ", 1)[1], "record")
    line = first_error_line(log_tail(log))
    if not code and not sig:
        return None
    reason, fix = _known(line) if line else ("", "")
    if not reason:
        if sig or (code is not None and code > 128):
            num = sig or code - 128  # type: ignore[operator]
            reason = f"killed by {_signal_name(num)}"
            fix = ("SIGKILL is often the memory limit (cluster.mem_gb) or the time limit (cluster.time_min)"
                   if num == 9 else "")
        elif code == 127:
            reason = "a command was not found"
        else:
            reason = MEANINGS.get(code, f"exit code {code}") if code is not None else "failed"
    return Explained(code, reason, line, fix, source or "log")


__all__ = ["Explained", "explain", "first_error_line", "log_tail", "read_record"]
