"""Pace, ETA, Slurm time left and requeues (:mod:`fsdp_workflow.report.status.eta`)."""

from __future__ import annotations

import pytest

from fsdp_workflow.report.curves import read_series
from fsdp_workflow.config.record import open_run
from fsdp_workflow.backends.base import JobStatus
from fsdp_workflow.report.status.eta import progress, progress_lines, run_progress, seconds_per_step, slurm_seconds

from .fixtures import MAX_STEPS, PACE_S, STEPS, write_run


@pytest.mark.parametrize("text, want", [("1-02:03:04", 93784.0), ("00:10:00", 600.0), ("05:30", 330.0),
                                        ("UNLIMITED", None), ("Partition_Limit", None), ("", None)])
def test_slurm_durations(text, want):
    assert slurm_seconds(text) == want


def test_pace_is_the_median_step_gap_and_ignores_the_requeue(tmp_path):
    s = read_series(write_run(tmp_path / "run").metrics)
    assert seconds_per_step(s) == pytest.approx(PACE_S)
    assert seconds_per_step(s.up_to(260)) == pytest.approx(PACE_S)  # the 120 s gap before 251 is in the window
    no_time = read_series(write_run(tmp_path / "r2", steps=3).metrics)
    no_time.times = [float("nan")] * 3
    assert seconds_per_step(no_time) == pytest.approx(0.45)  # the trainer's step_time_s instead


def _train(status: str, **kw) -> JobStatus:
    return JobStatus(role="train", job_id="42", status=status, **kw)


def test_eta_time_left_and_requeues(tmp_path):
    run = write_run(tmp_path / "run")
    jobs = [_train("done", restarts=1, max_requeues=3),
            _train("running", restarts=1, max_requeues=3, time_limit="00:30:00", run_time="00:26:00")]
    p = run_progress(open_run(run.root), jobs)
    assert (p.step, p.max_steps) == (STEPS, MAX_STEPS)
    assert p.eta_s == pytest.approx((MAX_STEPS - STEPS) * PACE_S)  # 500 steps x 0.5 s = 250 s
    assert (p.time_limit_s, p.time_left_s, p.train_job) == (1800.0, 240.0, "42")
    assert (p.requeues, p.max_requeues) == (2, 3)
    text = progress_lines(p)
    assert text == [
        f"progress: step {STEPS} of {MAX_STEPS} (50%), 0.5 s/step (median of the last 20), ETA 4m10s",
        "slurm time left: 4m00s of 30m00s (train job 42); training outlasts it: a requeue continues from the last checkpoint",
        "requeues: 2 of cluster.max_requeues=3",
    ]


def test_no_running_job_no_time_left_and_a_finished_run_says_done(tmp_path):
    run = write_run(tmp_path / "run")
    p = run_progress(open_run(run.root), [_train("queued", time_limit="00:30:00")])
    assert p.time_left_s is None and p.requeues == 0
    assert "slurm time left: no training job running" in progress_lines(p)
    done = progress(read_series(run.metrics), STEPS, [])
    assert progress_lines(done) == [f"progress: step {STEPS} of {STEPS} (100%), 0.5 s/step (median of the last 20), "
                                    "all steps done"]
    assert progress_lines(progress(read_series(tmp_path / "none.jsonl"), 10, [])) == []
