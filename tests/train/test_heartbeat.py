"""Heartbeats name the rank that stopped answering; failures are classified; fault hooks stay inert."""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.train import fault_hooks
from fsdp_workflow.train.failures import collective_timeout, disk_full, disk_full_detail, peer_timeout_reported
from fsdp_workflow.train.heartbeat import Heartbeat, beat_interval, who_stopped


def _beat(run: RunDir, rank: int, host: str, phase: str, age_s: float, now: float, interval: float = 1.0) -> None:
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    run.heartbeat(rank).write_text(json.dumps({"rank": rank, "host": host, "pid": 1000 + rank, "phase": phase,
                                               "beats": 3, "time": now - age_s, "interval_s": interval}))


def test_a_stale_heartbeat_is_named_with_host_pid_and_phase(tmp_path: Path) -> None:
    run, now = RunDir.of(tmp_path), 1_000_000.0
    _beat(run, 0, "n1", "step 7", 0.5, now)
    _beat(run, 1, "n1", "step 7", 0.2, now)
    _beat(run, 2, "n2", "step 6", 21.0, now)
    _beat(run, 3, "n2", "step 7", 0.4, now)
    text = who_stopped(run, world=4, me=0, now=now)
    assert text == "rank 2 on n2 (pid 1002) stopped answering: last heartbeat 21 s ago (it was then in 'step 6')"


def test_a_live_rank_stuck_in_another_phase_is_named(tmp_path: Path) -> None:
    run, now = RunDir.of(tmp_path), 1_000_000.0
    _beat(run, 0, "n1", "step 9", 0.1, now)
    _beat(run, 1, "n2", "saving step 8", 0.1, now)
    _beat(run, 2, "n3", "step 9", 0.1, now)
    assert "rank 1 on n2 (pid 1001) is still beating but stuck in 'saving step 8' while the others are in 'step 9'" \
        == who_stopped(run, world=3, me=0, now=now)


def test_nobody_singled_out_and_missing_files_are_said(tmp_path: Path) -> None:
    run, now = RunDir.of(tmp_path), 1_000_000.0
    _beat(run, 0, "n1", "step 2", 0.1, now)
    _beat(run, 1, "n1", "step 2", 0.1, now)
    assert "single out no rank" in who_stopped(run, world=2, me=0, now=now)
    assert "rank(s) [2] never wrote a heartbeat" in who_stopped(run, world=3, me=0, now=now)


def test_the_thread_rewrites_the_file_with_the_current_phase(tmp_path: Path) -> None:
    run = RunDir.of(tmp_path)
    beat = Heartbeat(run, 3, interval_s=0.05).start()
    try:
        beat.phase, beat.step = "step 12", 11
        time.sleep(0.3)
        rec = json.loads(run.heartbeat(3).read_text())
    finally:
        beat.stop()
    assert rec["phase"] == "step 12" and rec["step"] == 11 and rec["rank"] == 3 and rec["beats"] >= 3
    assert beat_interval(600) == 30 and beat_interval(8) == 1 and beat_interval(100) == 10


def _dcp_failure(exc: BaseException) -> CheckpointException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return CheckpointException("save failed", {1: _wrap_exception(e)})


def test_the_first_peer_timeout_report_of_an_attempt_stands(tmp_path: Path) -> None:
    """A stopped rank resumed by Slurm's SIGCONT times out at once and sees the peer that just
    exited still beating: its report names no one, so it must not replace the first one (seen on
    the two-node test Slurm under load). Earlier attempts' records and other exits do not count."""
    path = tmp_path / "train_exit.json"
    started = time.time()
    assert not peer_timeout_reported(tmp_path, started)  # nothing written yet
    path.write_text(json.dumps({"exit_code": 76, "reason": "rank 1 on n2 (pid 9) stopped answering"}))
    assert peer_timeout_reported(tmp_path, started)
    assert not peer_timeout_reported(tmp_path, started + 3600)  # written before this attempt began
    path.write_text(json.dumps({"exit_code": 74, "reason": "disk full"}))
    assert not peer_timeout_reported(tmp_path, started)
    path.write_text("{not json")
    assert not peer_timeout_reported(tmp_path, started)


def test_disk_full_is_found_inside_dcps_per_rank_failures(tmp_path: Path) -> None:
    enospc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.distcp"))
    wrapped = _dcp_failure(enospc)
    assert disk_full(wrapped) is enospc
    assert disk_full_detail(wrapped, tmp_path) == f"[Errno 28] No space left on device: '{tmp_path / 'x.distcp'}'"
    # A failure that is not about space, on a filesystem with room, is not a full disk.
    assert disk_full_detail(_dcp_failure(RuntimeError("unexpected pos 704 vs 598")), tmp_path) is None


def test_collective_timeouts_are_recognised_and_other_errors_are_not() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation")
    assert collective_timeout(_dcp_failure(gloo)) is gloo
    assert collective_timeout(RuntimeError("CUDA out of memory")) is None
    assert collective_timeout(ValueError("timeout")) is None


def test_fault_hooks_are_inert_unless_asked_and_refuse_nonsense() -> None:
    assert fault_hooks.from_env({}) is None
    fault = fault_hooks.from_env({fault_hooks.FAULT_ENV: "stop_in_save@4:1"})
    assert fault == fault_hooks.TestOnlyFault("stop_in_save", 4, 1)
    assert fault.in_save(4, 1) and not fault.in_save(4, 0) and not fault.in_save(2, 1)
    fault.at_step(4, 1)  # a save fault never stops a step
    with pytest.raises(ValueError, match="KIND@STEP"):
        fault_hooks.from_env({fault_hooks.FAULT_ENV: "explode@3"})
