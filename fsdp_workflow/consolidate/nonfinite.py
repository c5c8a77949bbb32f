"""Count NaN and inf in every byte the writer copies, so a diverged checkpoint is never shipped as "verified".

The scan rides on the copy (:class:`~.writer.StreamingWriter` hands it each slab it has just
assembled, in the output dtype, before writing it), so it sees every byte written whatever
the verification mode (fast mode samples slabs; ``--no-verify`` compares nothing) and adds
no read of its own. It works on the raw bits, the same way for every floating dtype, with no
float decoding (numpy has no bfloat16): a value is NaN or inf exactly when its exponent bits
are all ones, so ``bits | (sign and mantissa bits)`` is all ones exactly then, and one
``bitwise_or`` into a reusable buffer plus one ``max`` (both vectorised, the GIL released)
answer for a whole slab. Only a slab that holds one is looked at again, to count NaN
(mantissa non-zero) and inf (mantissa zero) apart.

Cost: about 50 us per 512 KiB slab on one core here (10 GB/s); see docs/consolidation.md,
Benchmark, for what it adds to a whole consolidation.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypedDict

from fsdp_workflow.core.exit_codes import EXIT_NONFINITE

from .consolidation_errors import ConsolidationError

if TYPE_CHECKING:
    import numpy as np

# dtype -> (unsigned view, sign|mantissa bits, mantissa bits; 0: the format has no inf, every all-ones value is NaN)
_BITS: dict[str, tuple[str, int, int]] = {
    "float64": ("uint64", 0x800F_FFFF_FFFF_FFFF, 0x000F_FFFF_FFFF_FFFF),
    "float32": ("uint32", 0x807F_FFFF, 0x007F_FFFF),
    "float16": ("uint16", 0x83FF, 0x03FF),
    "bfloat16": ("uint16", 0x807F, 0x007F),
    "float8_e5m2": ("uint8", 0x83, 0x03),
    # e4m3fn has no inf: S.1111.111 is its only NaN, so sign-or-ing leaves 0xFF exactly for it
    "float8_e4m3fn": ("uint8", 0x80, 0),
}
_PIECE_ELEMS = 1 << 18  # elements per bitwise_or, bounding the reusable buffer (a 512 KiB bf16 slab is one piece)


class BadCount(TypedDict):
    """How many values of one tensor are NaN and how many are +-inf."""

    nan: int
    inf: int


class NonFiniteWeightsError(ConsolidationError):
    """The weights hold NaN or inf and ``--allow-nonfinite`` was not given; nothing was written.

    The CLI exits with :data:`~fsdp_workflow.core.exit_codes.EXIT_NONFINITE` (65).
    """

    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, counts: dict[str, BadCount]) -> None:
        super().__init__(message)
        self.counts = counts


class NonFiniteScan:
    """Per output tensor, the NaN and inf counts of the bytes handed to :meth:`scan` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._counts: dict[str, BadCount] = {}

    def scan(self, name: str, dtype: str, data: memoryview | bytes | bytearray) -> None:
        """Count the NaN and inf in ``data``, raw little-endian values of ``dtype``, as part of tensor ``name``.

        Args:
            name: The output tensor the bytes belong to.
            dtype: Their torch dtype name; non-floating dtypes are skipped.
            data: Whole values (a slab as the writer wrote it).
        """
        bits = _BITS.get(dtype)
        if bits is None or not len(data):
            return
        import numpy as np

        view, others, mantissa = bits
        values = np.frombuffer(data, dtype=view)
        all_ones = (1 << (8 * values.itemsize)) - 1
        for start in range(0, values.size, _PIECE_ELEMS):
            piece = values[start:start + _PIECE_ELEMS]
            tmp = self._buffer(view, np)[:piece.size]
            np.bitwise_or(piece, others, out=tmp)
            if tmp.max() != all_ones:  # the usual case: every value finite
                continue
            bad = tmp == all_ones
            inf = int(np.count_nonzero(bad & ((piece & mantissa) == 0))) if mantissa else 0
            nan = int(np.count_nonzero(bad)) - inf
            with self._lock:
                count = self._counts.setdefault(name, {"nan": 0, "inf": 0})
                count["nan"] += nan
                count["inf"] += inf

    def _buffer(self, view: str, np: object) -> np.ndarray:
        """This thread's reusable output buffer for ``bitwise_or``, one per view dtype."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        buf = bufs.get(view)
        if buf is None:
            buf = bufs[view] = np.empty(_PIECE_ELEMS, dtype=view)  # type: ignore[attr-defined]
        return buf

    def found(self) -> dict[str, BadCount]:
        """The tensors holding NaN or inf, by name (sorted), with their counts; empty when all are finite."""
        with self._lock:
            return {k: dict(v) for k, v in sorted(self._counts.items())}  # type: ignore[misc]


def describe(name: str, count: BadCount) -> str:
    """``'a' (3 NaN, 1 inf)`` for a message or the model card."""
    what = [f"{count['nan']} NaN"] if count["nan"] else []
    what += [f"{count['inf']} inf"] if count["inf"] else []
    return f"'{name}' ({', '.join(what)})"


def refusal(counts: dict[str, BadCount], source: str, cast_to: str | None) -> NonFiniteWeightsError:
    """The error for non-finite weights when they were not allowed: every tensor named, with its counts.

    Args:
        counts: From :meth:`NonFiniteScan.found` (not empty).
        source: The checkpoint directory, for the message.
        cast_to: The dtype asked for with ``--dtype`` (values beyond its range become inf), or None.
    """
    total_nan = sum(c["nan"] for c in counts.values())
    total_inf = sum(c["inf"] for c in counts.values())
    cast = (f" With --dtype, values beyond {cast_to}'s range become inf: if the checkpoint itself is finite, "
            "keep its dtype (leave --dtype out) or cast to a wider one.") if cast_to else ""
    listing = "".join(f"\n  - {describe(name, c)}" for name, c in counts.items())
    return NonFiniteWeightsError(
        f"{source}: the weights hold non-finite values ({total_nan} NaN, {total_inf} inf) in {len(counts)} "
        f"tensor(s), listed below. Refusing to write a model that cannot be used; nothing was written. "
        "Usually the run diverged: consolidate an earlier step (--step N), or pass --allow-nonfinite to write them "
        f"on purpose (verification.json and the model card then name these tensors).{cast}{listing}", counts)
