"""A small loss-curve PNG drawn with the standard library (zlib), for the model card.

matplotlib costs a consolidation about a second and 50 MB to import; this draws the card's
640x360 image in milliseconds: the training loss as a line (each pixel column's min and
max, so spikes stay), eval losses as dots, a grid with numeric tick labels in a 3x5 pixel
font. ``status --plot`` draws the fuller picture with matplotlib (:func:`.curves.write_png`).
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from pathlib import Path
from typing import List, Tuple

from fsdp_workflow.core.curves import Series, bridge, columns, finite

WIDTH, HEIGHT = 640, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 58, 14, 14, 34  # margins, pixels
_SCALE = 2  # font pixels per glyph dot
Color = Tuple[int, int, int]
WHITE, AXIS, GRID, TEXT = (255, 255, 255), (120, 120, 120), (228, 228, 228), (60, 60, 60)
LOSS, EVAL = (31, 119, 180), (255, 127, 14)  # matplotlib's first two colours
# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left)
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0), "k": (4, 5, 6, 5, 5), "M": (5, 7, 7, 5, 5), "e": (0, 7, 7, 4, 7),
}


class _Canvas:
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(bytes(WHITE) * (w * h))

    def set(self, x: int, y: int, c: Color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def hline(self, x0: int, x1: int, y: int, c: Color) -> None:
        for x in range(x0, x1 + 1):
            self.set(x, y, c)

    def vline(self, x: int, y0: int, y1: int, c: Color) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            self.set(x, y, c)

    def text(self, x: int, y: int, s: str, c: Color) -> None:
        for k, ch in enumerate(s):
            for r, bits in enumerate(_FONT.get(ch, (0,) * 5)):
                for b in range(3):
                    if bits & (4 >> b):
                        for dx in range(_SCALE):
                            for dy in range(_SCALE):
                                self.set(x + (4 * k + b) * _SCALE + dx, y + r * _SCALE + dy, c)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def text_width(s: str) -> int:
    return (4 * len(s) - 1) * _SCALE


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    raw = (hi - lo) / max(1, count - 1) or 1.0
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _tick_label(v: float, step: float) -> str:
    if abs(v) >= 1e6 and step >= 1e5:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e4 and step >= 1e3:
        return f"{v / 1e3:g}k"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    return f"{v:.{decimals}f}"


def loss_png(series: Series, out: Path) -> Path:
    """Draw the loss curve (and eval losses) into ``out``, written under a temporary name and renamed.

    Raises:
        ValueError: the series has no finite loss.
    """
    xs, ys = finite(series.steps, series.loss)
    if not xs:
        raise ValueError("no finite training loss to draw")
    ex, ey = series.eval_steps, series.eval_loss
    lo, hi = min(ys + ey), max(ys + ey)
    pad = (hi - lo) * 0.05 or 0.5
    lo, hi = lo - pad, hi + pad
    x0, x1 = min(xs + ex), max(xs + ex)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    cv = _Canvas(WIDTH, HEIGHT)
    left, right, top, bottom = _LEFT, WIDTH - _RIGHT, _TOP, HEIGHT - _BOTTOM
    pw, ph = right - left, bottom - top

    def px(x: float) -> int:
        return left + round((x - x0) / (x1 - x0) * (pw - 1))

    def py(y: float) -> int:
        return top + round((hi - y) / (hi - lo) * (ph - 1))

    yt = nice_ticks(lo, hi)
    for v in yt:
        cv.hline(left, right, py(v), GRID)
        lab = _tick_label(v, yt[1] - yt[0] if len(yt) > 1 else 1.0)
        cv.text(left - 6 - text_width(lab), py(v) - 5, lab, TEXT)
    xt = [v for v in nice_ticks(x0, x1, 6) if v == int(v)]
    for v in xt:
        cv.vline(px(v), top, bottom, GRID)
        lab = _tick_label(v, xt[1] - xt[0] if len(xt) > 1 else 1.0)
        cv.text(px(v) - text_width(lab) // 2, bottom + 8, lab, TEXT)
    cv.hline(left, right, top, AXIS)
    cv.hline(left, right, bottom, AXIS)
    cv.vline(left, top, bottom, AXIS)
    cv.vline(right, top, bottom, AXIS)
    prev = None
    for c, mm in enumerate(bridge(columns(xs, ys, pw, x0, x1))):
        if mm is None:
            continue
        a, b = py(mm[1]), py(mm[0])
        if prev is not None:  # join to the previous column
            a, b = min(a, prev[1]), max(b, prev[0])
        cv.vline(left + c, a, b, LOSS)
        prev = (py(mm[1]), py(mm[0]))
    for x, y in zip(ex, ey):
        for dx in range(-3, 4):
            for dy in range(-3, 4):
                if dx * dx + dy * dy <= 10:
                    cv.set(px(x) + dx, py(y) + dy, EVAL)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(cv.png())
    os.replace(tmp, out)
    return out


__all__ = ["HEIGHT", "WIDTH", "loss_png", "nice_ticks"]
