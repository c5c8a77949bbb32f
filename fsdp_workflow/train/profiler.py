"""``train.profile_steps=[FIRST,LAST]``: torch.profiler over those optimizer steps, on every rank.

The profiler starts as step FIRST begins and stops when step LAST ends (steps
count from 1, as in ``metrics.jsonl``); each step inside is a ``record_function``
range named ``step N``. Evaluation and checkpoint saves between steps run outside
the ranges, and nothing outside the window is recorded. Then each rank writes:

* ``RUN_DIR/profile/rank<R>.trace.json``: the Chrome trace (Perfetto, chrome://tracing);
* ``RUN_DIR/profile/rank<R>.key_averages.txt``: ``key_averages()`` as a table, sorted
  by self device time (CUDA) or, on CPU, by self CPU time; its first line says which
  and names the steps recorded.

CPU activity is always recorded, CUDA kernels when the device is a GPU. Both files
are written beside their final name and renamed into place, so a file under its
final name is whole. A run that stops inside the window (a signal, a non-finite
loss) writes what it recorded, and the header names the steps it covers. A run
resumed past LAST records nothing; one resumed inside the window records from its
first step. Exporting fails softly: training goes on and the reason is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional, Sequence

import torch

from fsdp_workflow.core.rundir import TMP_SUFFIX, RunDir, atomic_write_text

logger = logging.getLogger(__name__)

TABLE_ROWS = 60  # rows of the key_averages table; the trace holds every op


class StepProfiler:
    """Profiles the optimizer steps of ``window`` on this rank; does nothing when ``window`` is None.

    Args:
        window: ``train.profile_steps`` (``[FIRST, LAST]``, validated at planning) or None.
        run: the run directory (its ``profile/`` names).
        rank: this process's global rank.
        device: the training device (``cuda``: CUDA activities too).
    """

    def __init__(self, window: Optional[Sequence[int]], run: RunDir, rank: int, device: torch.device) -> None:
        self.first, self.last = (int(window[0]), int(window[1])) if window else (0, -1)
        self.run, self.rank, self.cuda = run, rank, device.type == "cuda"
        self._prof: Optional[Any] = None
        self._steps: list[int] = []

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Run optimizer step ``n`` (1-based) inside the profile when it is in the window."""
        if not self.first <= n <= self.last:
            yield
            return
        if self._prof is None:
            self._start()
        with torch.profiler.record_function(f"step {n}"):
            yield
        self._steps.append(n)
        if n == self.last:
            self.close()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def close(self) -> None:
        """Stop a running profile and write its files (at LAST, or when the run stops inside the window)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        try:
            self._write(prof)
        except (OSError, RuntimeError) as err:  # a profile is never worth the run
            logger.warning("rank %d: the profile of steps %s was not written: %s", self.rank, self._covered(), err)

    def _covered(self) -> str:
        return f"{self._steps[0]}-{self._steps[-1]}" if self._steps else "(none completed)"

    def _write(self, prof: Any) -> None:
        self.run.profile.mkdir(parents=True, exist_ok=True)
        trace = self.run.profile_trace(self.rank)
        tmp = trace.with_name(f".{trace.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, trace)
        finally:
            tmp.unlink(missing_ok=True)
        sort_by, what = ("self_device_time_total", "self CUDA time") if self.cuda else ("self_cpu_time_total",
                                                                                       "self CPU time")
        header = (f"# rank {self.rank}, optimizer steps {self._covered()} (train.profile_steps="
                  f"[{self.first},{self.last}]): torch.profiler key_averages, sorted by {what}\n")
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        atomic_write_text(self.run.profile_table(self.rank), header + table + "\n")
        logger.info("rank %d: profile of steps %s written to %s", self.rank, self._covered(), self.run.profile)
