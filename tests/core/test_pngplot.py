"""The model card's loss curve PNG (:mod:`fsdp_workflow.core.pngplot`), decoded back with zlib and read pixel by pixel."""

from __future__ import annotations

import struct
import zlib

from fsdp_workflow.core.curves import Series
from fsdp_workflow.core.pngplot import EVAL, HEIGHT, LOSS, WIDTH, loss_png, nice_ticks


def _pixels(data: bytes) -> list:
    """Rows of (r, g, b) of an 8-bit RGB PNG written without row filters."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0], kind
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = size
    raw = zlib.decompress(idat)
    rows = [raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return [[tuple(r[1 + 3 * x:4 + 3 * x]) for x in range(w)] for r in rows]


def test_nice_ticks():
    assert nice_ticks(1.93, 5.71) == [2.0, 3.0, 4.0, 5.0]
    assert nice_ticks(1, 400, 6) == [100.0, 200.0, 300.0, 400.0]
    assert nice_ticks(0.0, 0.05) == [0.0, 0.02, 0.04]


def test_a_10000_step_curve_keeps_its_spike_and_eval_dots(tmp_path):
    steps = list(range(1, 10001))
    loss = [3.0 - s / 10000 for s in steps]
    loss[7000] = 6.0  # step 7001: one bad batch among 10000 steps drawn into ~570 pixel columns
    s = Series(steps=steps, loss=loss, eval_steps=[2500, 5000], eval_loss=[2.8, 2.6])
    out = loss_png(s, tmp_path / "curve.png")
    px = _pixels(out.read_bytes())
    assert (len(px[0]), len(px)) == (WIDTH, HEIGHT)
    top_loss_row = min(y for y in range(HEIGHT) if LOSS in px[y])
    spike_cols = [x for x in range(WIDTH) if px[top_loss_row][x] == LOSS]
    assert len(spike_cols) <= 2 and abs(spike_cols[0] - (58 + 0.7 * (WIDTH - 72))) < 3  # at step ~7000
    assert sum(row.count(EVAL) for row in px) >= 2 * 20  # two dots of about 29 pixels each
    assert not list(tmp_path.glob(".*.tmp"))
