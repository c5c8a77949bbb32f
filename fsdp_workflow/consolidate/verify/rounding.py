"""Is every output value the correctly rounded source value? A check written apart from the cast.

The writer casts with bit arithmetic (:mod:`fsdp_workflow.consolidate.casting`: add a rounding bias, shift). This
module checks the result by the definition instead, so a wrong formula, a cast applied to
the wrong tensor or values from the wrong place all show: for each element, with the
source value ``x`` and the output value ``y`` both widened exactly to float64,

* NaN stays NaN, and the sign never changes (``-1e-40`` rounds to ``-0``);
* ``y`` is a nearest representable value: no neighbour of ``y`` (one bit pattern up or
  down) is closer to ``x``; on a tie the pattern of ``y`` is even (round half to even);
* ``y`` is infinite exactly when ``x`` is, or when ``|x|`` reaches the halfway point past
  the largest finite value (where round-to-nearest-even overflows).

Values are decoded here from their bit patterns (bf16: the pattern is the top half of a
float32), not with :func:`~.casting.to_f32`. The float64 arithmetic is exact for sources of
float32 or narrower; a float64 source within 2**-53 of a halfway point could be misjudged,
which a float64 -> narrower cast of real weights does not meet in practice.
"""

from __future__ import annotations

import numpy as np

# target dtype -> (bit-pattern dtype, magnitude mask, pattern of +inf)
_BITS: dict[str, tuple[np.dtype, int, int]] = {
    "bfloat16": (np.dtype("<u2"), 0x7FFF, 0x7F80),
    "float16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
    "float32": (np.dtype("<u4"), 0x7FFFFFFF, 0x7F800000),
    "float64": (np.dtype("<u8"), 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Float64 values of little-endian ``dtype`` bit patterns (``raw``: the pattern dtype of :data:`_BITS`)."""
    if dtype == "bfloat16":
        wide = np.zeros(raw.shape + (2,), dtype="<u2")
        wide[..., 1] = raw  # bf16 is the high half of a float32
        return wide.view("<f4")[..., 0].astype(np.float64)
    return raw.view({"float16": "<f2", "float32": "<f4", "float64": "<f8"}[dtype]).astype(np.float64)


def patterns(buf: np.ndarray, dtype: str) -> np.ndarray:
    """View raw bytes as the bit patterns of ``dtype``."""
    return buf.view(_BITS[dtype][0])


def badly_rounded(x: np.ndarray, y_bits: np.ndarray, dtype: str) -> np.ndarray:
    """Indices (flat) where ``y_bits`` is not ``x`` rounded to nearest-even in ``dtype``.

    Args:
        x: Exact source values, float64 (any shape).
        y_bits: The output's bit patterns, same shape.
        dtype: The output dtype (``bfloat16``, ``float16``, ``float32`` or ``float64``).

    Returns:
        Flat indices of the elements that fail (empty when all are right).
    """
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf inputs are judged below, not warned about
        return _badly_rounded(x, y_bits, dtype)


def _badly_rounded(x: np.ndarray, y_bits: np.ndarray, dtype: str) -> np.ndarray:
    pat, mask, inf_bits = _BITS[dtype]
    x = x.reshape(-1)
    yb = y_bits.reshape(-1).astype(pat, copy=False)
    mag = yb & pat.type(mask)
    y = decode(yb, dtype)
    xnan, ynan = np.isnan(x), np.isnan(y)
    bad = xnan != ynan
    ok = ~(xnan | ynan)
    bad |= ok & (np.signbit(x) != np.signbit(y)) & ~((x == 0) & (y == 0) & (np.signbit(x) == np.signbit(y)))
    # the halfway point past the largest finite value: where rounding overflows to inf
    top = decode(np.array([inf_bits - 1], dtype=pat), dtype)[0]
    below = decode(np.array([inf_bits - 2], dtype=pat), dtype)[0]
    limit = top + (top - below) / 2
    ax = np.abs(x)
    should_inf = ok & (np.isinf(x) | (ax >= limit))
    bad |= ok & (should_inf != np.isinf(y))
    finite = ok & ~should_inf & ~np.isinf(y)
    if finite.any():
        ay = np.abs(y)
        up = np.abs(decode(mag + pat.type(1), dtype))  # the next pattern away from zero (may be inf)
        down = np.abs(decode(np.maximum(mag, pat.type(1)) - pat.type(1), dtype))  # toward zero (0 stays 0)
        d = np.abs(ax - ay)
        d_up, d_down = np.abs(ax - up), np.abs(ax - down)
        farther = (d > d_up) | ((d > d_down) & (mag > 0))
        tie = (d > 0) & ((d == d_up) | ((d == d_down) & (mag > 0)))
        bad |= finite & (farther | (tie & ((mag & pat.type(1)) == 1)))
    return np.flatnonzero(bad)
