"""prepare's tokenising workers (fsdp_workflow/data/workers.py): order, errors, deaths, group signals.

    python -m pytest tests/data/test_workers.py

The signal test is the CI hang this module replaced multiprocessing.Pool for: SIGTERM to
the whole process group while a worker waits for work. Pool's idle worker dies holding
the task queue's lock and ``Pool.terminate`` waits for it forever; here the command
exits 143 within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdp_workflow.data.workers import WorkerDied, ordered_map


def _square(x: int) -> int:
    if x == 13:
        raise ValueError("thirteen is refused")
    return x * x


def _die_on_5(x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer ends a worker
    return x


def test_results_come_back_in_input_order_from_every_worker() -> None:
    items = [i for i in range(40) if i != 13]
    assert list(ordered_map(_square, iter(items), 3)) == [i * i for i in items]


def _megabyte(item: bytes) -> bytes:
    return item + b"r" * (1 << 20)


@pytest.mark.timeout(60)  # the deadlock this guards against is a hang
def test_chunks_and_results_larger_than_the_pipe_do_not_deadlock() -> None:
    """A 1 MB chunk sent while its worker sends a 1 MB result (a 512-record chunk of chat is about that)."""
    t0 = time.monotonic()
    out = list(ordered_map(_megabyte, (bytes([i]) * (1 << 20) for i in range(12)), 2))
    assert [r[0] for r in out] == list(range(12)) and all(len(r) == 2 << 20 for r in out)
    assert time.monotonic() - t0 < 30


def test_an_error_in_a_worker_is_raised_for_its_item_and_no_worker_is_left(tmp_path: Path) -> None:
    def children() -> set:
        return set(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())

    before, seen = children(), []  # (this process may have children of other tests: only new ones count)
    with pytest.raises(ValueError, match="thirteen is refused"):
        for r in ordered_map(_square, range(20), 2):
            seen.append(r)
            if r == 0:
                assert len(children() - before) == 2  # the two workers are up
    assert seen == [i * i for i in range(13)]
    assert children() - before == set()


def test_a_worker_killed_by_the_kernel_is_named_with_its_signal() -> None:
    with pytest.raises(WorkerDied, match=r"exit code -9 .*data.num_workers"):
        list(ordered_map(_die_on_5, range(12), 2))


def test_sigterm_to_the_group_while_workers_wait_ends_the_command_in_seconds(tmp_path: Path) -> None:
    script = tmp_path / "slow_feed.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from fsdp_workflow.core.interrupts import sigterm_as_ctrl_c
        from fsdp_workflow.data.workers import ordered_map

        def double(x):
            return 2 * x

        def slow():  # the workers are idle most of the time, waiting for the next item
            for i in range(10_000):
                yield i
                time.sleep(0.1)

        sigterm_as_ctrl_c()
        try:
            for r in ordered_map(double, slow(), 2):
                print(r, flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(143)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "0"  # the workers are up and answering
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)  # kill -- -PGID: the parent and both workers
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the command did not end after SIGTERM (the Pool deadlock)")
    assert proc.returncode == 143 and "interrupted" in out, (proc.returncode, out, err)
    assert "Traceback" not in err, err
