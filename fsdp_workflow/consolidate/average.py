"""Weighted averaging of one tensor across checkpoints, accumulated in float32.

Only one output tensor (plus one source chunk) is held at a time, so memory does not grow
with the number of checkpoints averaged.
"""

from __future__ import annotations

from .casting import FLOAT_NAMES, from_f32, to_f32
from .consolidation_errors import ConsolidationError
from .metadata import dtype_info
from .reader import ChunkHandle, SourceTensor


def normalise_weights(weights: list[float] | None, n: int) -> list[float]:
    """Default to equal weights; otherwise check the count and scale them to sum to 1."""
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ConsolidationError(f"--weights has {len(weights)} values but {n} checkpoints are averaged; give one weight per step")
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ConsolidationError(f"--weights {weights}: weights must be non-negative and sum to more than 0")
    return [w / total for w in weights]


def accumulate(sources: list[SourceTensor], weights: list[float], out_dtype: str) -> bytes:
    """Return ``sum(w_i * source_i)`` encoded as ``out_dtype`` bytes.

    Non-floating tensors (step counters, int buffers) are taken from the last source.
    """
    import numpy as np

    shape = sources[0].shape
    for s in sources[1:]:
        if s.shape != shape:
            raise ConsolidationError(f"tensor '{s.fqn}' has shape {list(s.shape)} in one checkpoint and {list(shape)} in another; cannot average")
    if sources[-1].dtype not in FLOAT_NAMES:
        return _read_full(sources[-1])
    acc = np.zeros(shape, dtype=np.float32)
    for src, w in zip(sources, weights):
        for chunk in src.chunks:
            h = ChunkHandle(chunk, src.dtype)
            try:
                arr = to_f32(h.read(0, chunk.numel * dtype_info(src.dtype)[1]), src.dtype).reshape(chunk.sizes)
            finally:
                h.close()
            region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
            acc[region] += np.float32(w) * arr
    return from_f32(acc, out_dtype)


def _read_full(src: SourceTensor) -> bytes:
    import numpy as np

    item = dtype_info(src.dtype)[1]
    out = np.zeros(src.numel * item, dtype=np.uint8).reshape(*src.shape, item) if src.shape else np.zeros(item, np.uint8)
    for chunk in src.chunks:
        h = ChunkHandle(chunk, src.dtype)
        try:
            arr = np.frombuffer(h.read(0, chunk.numel * item), np.uint8).reshape(*chunk.sizes, item)
        finally:
            h.close()
        region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        out[region] = arr
    return out.tobytes()
