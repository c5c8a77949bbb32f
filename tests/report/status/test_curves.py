"""The terminal curves (:mod:`fsdp_workflow.report.status.text_curves`) drawn from a metrics.jsonl fixture."""

from __future__ import annotations

from fsdp_workflow.report.curves import columns, read_series
from fsdp_workflow.report.status.text_curves import EVAL_MARK, curve_block, plot

from .fixtures import EVAL_EVERY, SPIKE_LOSS, SPIKE_STEP, STEPS, eval_at, loss_at, write_run


def _blank(ch: str) -> bool:
    return ch in " \u2800"


def test_series_takes_the_last_line_of_a_redone_step_and_skips_torn_lines(tmp_path):
    s = read_series(write_run(tmp_path / "run").metrics)
    assert s.steps == list(range(1, STEPS + 1))
    assert s.loss[249] == loss_at(250)  # not the 99.0 logged before the crash
    assert s.eval_steps == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert read_series(tmp_path / "missing.jsonl").steps == []


def test_columns_keep_min_and_max_so_a_one_step_spike_survives():
    xs = list(range(1000))
    ys = [1.0] * 1000
    ys[555] = 50.0
    cols = columns(xs, ys, 10, 0, 999)
    assert len(cols) == 10 and all(c is not None for c in cols)
    assert cols[5] == (1.0, 50.0)  # 555 / 999 * 9 = 5.0: column 5
    assert sum(1 for c in cols if c and c[1] == 50.0) == 1


def test_loss_curve_of_500_steps_fits_80_columns_and_shows_the_spike(tmp_path):
    lines = curve_block(read_series(write_run(tmp_path / "run").metrics), 80)
    assert max(len(l) for l in lines) <= 80, "\n".join(lines)
    head = lines[0]
    assert head.startswith(f"loss (step {STEPS}: {loss_at(STEPS):.4f}; eval {eval_at(STEPS):.4f} at step {STEPS}")
    chart = lines[1:11]
    # y labels: the spike's 9.000 at the top, the lowest loss at the bottom, ticks on those rows
    assert chart[0].startswith(f"{SPIKE_LOSS:.3f} ┤")
    assert chart[-1].startswith(f"{min(loss_at(s) for s in range(1, STEPS + 1)):.3f} ┤")
    # 500 steps over 73 columns: the spike at step 300 is one dot column wide and still drawn on the top row
    x_axis = lines[12]
    left = x_axis.index("1")
    assert x_axis.rstrip().endswith(str(STEPS)) and x_axis.strip().startswith("1")
    plot_w = len(lines[11]) - lines[11].index("└") - 1
    spike_col = left + round((SPIKE_STEP - 1) / (STEPS - 1) * (plot_w - 1))
    top = chart[0]
    assert any(not _blank(ch) for ch in top[spike_col - 1:spike_col + 2]), "\n".join(lines)
    assert all(_blank(ch) for ch in top[left + 10:spike_col - 2])  # nothing else is that high
    # five evaluations, each drawn as a mark
    assert sum(l.count(EVAL_MARK) for l in chart) == STEPS // EVAL_EVERY
    # tokens/s and MFU side by side, with their last values
    assert any(l.startswith(f"tokens/s (last {8000 + STEPS:,})") and f"MFU % (last {100 * (0.30 + STEPS / 1e5):.2f})" in l
               for l in lines)


def test_curve_never_exceeds_the_width_it_is_given():
    xs = list(range(1, 20001))
    ys = [1e6 / x for x in xs]
    for width in (40, 61, 80, 120):
        assert max(len(l) for l in plot(xs, ys, width, 6)) <= width


def test_no_logged_step_says_so(tmp_path):
    run = write_run(tmp_path / "run", steps=0)
    assert curve_block(read_series(run.metrics)) == ["curves: no training step logged in metrics.jsonl yet"]
