"""Dtype conversion of raw little-endian tensor bytes with numpy, matching torch's rounding.

numpy has no bfloat16, so bf16 is handled as uint16 bit patterns: widening is a shift,
narrowing rounds to nearest even and maps every NaN to 0x7FC0, as ``c10::BFloat16`` does.
numpy is imported only when a cast runs: a plain consolidation with ``--no-verify`` never
needs it, and its import is a tenth of such a run's time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_NP = {  # numpy dtype names
    "float64": "float64", "float32": "float32", "float16": "float16",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
}
FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")
CLI_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
              "fp32": "float32", "float32": "float32"}


def to_f32(buf: bytes | memoryview, dtype: str) -> np.ndarray:
    """Decode bytes of ``dtype`` into a float32 array (copying)."""
    import numpy as np

    if dtype == "bfloat16":
        return (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype in _NP:
        return np.frombuffer(buf, dtype=_NP[dtype]).astype(np.float32)
    raise ValueError(f"cannot convert {dtype} to float32")


def from_f32(arr: np.ndarray, dtype: str) -> bytes:
    """Encode a float32 array as ``dtype`` bytes, rounding like torch."""
    import numpy as np

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "bfloat16":
        u = arr.view(np.uint32)
        out = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(arr)
        if nan.any():
            out[nan] = 0x7FC0
        return out.tobytes()
    with np.errstate(over="ignore"):  # out-of-range values become inf, as in torch
        return arr.astype(_NP[dtype]).tobytes()


def cast_bytes(buf: bytes | memoryview, src: str, dst: str) -> bytes:
    """Convert raw tensor bytes from ``src`` to ``dst`` dtype (both floating point)."""
    import numpy as np

    if src == dst:
        return bytes(buf)
    if src in ("float64", "float16") and dst in ("float64", "float16", "float32") and "bfloat16" not in (src, dst):
        with np.errstate(over="ignore"):
            return np.frombuffer(buf, dtype=_NP[src]).astype(_NP[dst]).tobytes()
    return from_f32(to_f32(buf, src), dst)
