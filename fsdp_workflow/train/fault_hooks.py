"""Test-only fault hooks: inert unless ``FSDP_WORKFLOW_TEST_FAULT`` is set.

The reliability tests (docs/reliability.md) inject faults into real runs: a rank
that stops answering mid-run or in the middle of a checkpoint save. Killing a
process from outside cannot aim at "inside the save, after the shards are
written", so the trainer reads one environment variable::

    FSDP_WORKFLOW_TEST_FAULT="stop@3:1"           rank 1 sends itself SIGSTOP as step 3 begins
    FSDP_WORKFLOW_TEST_FAULT="stop_in_save@2:1"   rank 1 stops itself inside the save of step 2,
                                                  after writing its shards, before .metadata exists

A stopped process neither dies nor answers: exactly a hung rank.
``FSDP_WORKFLOW_TEST_SAVE_DELAY_S=N`` pauses every save for N seconds before
``.metadata`` is written (a window to kill -9 the job in). When the variables
are unset :func:`from_env` returns None and the trainer never calls
into this module again; nothing on the normal path pays for it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torch.distributed.checkpoint import FileSystemWriter

FAULT_ENV = "FSDP_WORKFLOW_TEST_FAULT"
# Seconds to sleep after the shards are written and before .metadata and the rename.
SAVE_DELAY_ENV = "FSDP_WORKFLOW_TEST_SAVE_DELAY_S"
KINDS = ("stop", "stop_in_save")


@dataclass(frozen=True)
class TestOnlyFault:
    """One injected fault: ``kind`` at optimizer step ``step`` on global rank ``rank``."""

    __test__ = False  # not a pytest class

    kind: str
    step: int
    rank: int

    def hang_now(self) -> None:
        """Stop this process (SIGSTOP): it keeps its sockets and files and answers nothing."""
        os.write(sys.stderr.fileno(), f"[fsdp_workflow] TEST FAULT {FAULT_ENV}: rank {self.rank} stops itself "
                                      f"({self.kind} at step {self.step})\n".encode())
        os.kill(os.getpid(), signal.SIGSTOP)

    def at_step(self, step: int, rank: int) -> None:
        """Called as optimizer step ``step`` begins."""
        if self.kind == "stop" and step == self.step and rank == self.rank:
            self.hang_now()

    def in_save(self, step: int, rank: int) -> bool:
        return self.kind == "stop_in_save" and step == self.step and rank == self.rank


def from_env(environ: Optional[dict[str, str]] = None) -> Optional[TestOnlyFault]:
    """The fault ``FSDP_WORKFLOW_TEST_FAULT`` asks for, or None (the normal case).

    Raises:
        ValueError: the variable is set but malformed (a test bug, reported loudly).
    """
    spec = (environ if environ is not None else os.environ).get(FAULT_ENV, "").strip()
    if not spec:
        return None
    try:
        kind, _, where = spec.partition("@")
        step, _, rank = where.partition(":")
        fault = TestOnlyFault(kind, int(step), int(rank or 0))
    except ValueError:
        fault = TestOnlyFault("", 0, 0)
    if fault.kind not in KINDS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected KIND@STEP[:RANK] with KIND in {KINDS}")
    return fault


def save_writer(tmp: Path, step: int, rank: int, fault: Optional[TestOnlyFault]) -> FileSystemWriter:
    """DCP's ``FileSystemWriter`` for ``tmp``; a test-only variant when a fault or delay is asked for."""
    delay = float(os.environ.get(SAVE_DELAY_ENV, "0") or 0)
    if fault is not None and fault.in_save(step, rank):
        return _StopAfterWrite(tmp, fault=fault)
    return _DelayedWriter(tmp, delay_s=delay) if delay > 0 else FileSystemWriter(tmp)


class _StopAfterWrite(FileSystemWriter):
    """Writes this rank's shards, then stops the process (before the coordinator's ``.metadata``)."""

    def __init__(self, *args: Any, fault: TestOnlyFault, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fault = fault

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()
        self._fault.hang_now()
        return future


class _DelayedWriter(FileSystemWriter):
    """Pauses before writing ``.metadata``, so a test can kill -9 the job in the middle of a save."""

    def __init__(self, *args: Any, delay_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delay_s = delay_s

    def finish(self, metadata: Any, results: Any) -> None:
        time.sleep(self._delay_s)
        super().finish(metadata, results)
