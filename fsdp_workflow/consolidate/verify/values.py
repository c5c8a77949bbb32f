"""The value pass of verification: one output tensor against its source chunks, in bounded memory.

The output tensor is read back from its file in slabs, in order (so its checksum comes in the
same pass), at the offset the file's own header gives. On each slab every source chunk that
meets it is placed by its box, ``out[o0:o0+s0, o1:o1+s1, ...]``, from its bytes as
:mod:`.expected` located them; no run arithmetic of the writer is used. Where the dtype is kept
the bytes must be equal: the box is walked as the contiguous runs it covers in the slab
(:func:`region_runs`, tested against numpy slicing) and each run compared with ``memcmp``
(through ctypes, which releases the GIL), so the default check imports neither numpy nor
anything else beyond the standard library and xxhash: numpy's import alone was a quarter
of what the fast mode added to a copy at 1.5 GB. Where the dtype was cast every value must
be the source value correctly rounded (:mod:`.rounding`, with numpy slicing); an averaged
tensor is recomputed in float32 from every checkpoint, in the same order of operations as the
writer's, then checked for rounding.

Memory: two reusable slab buffers per thread (:class:`SlabBuffers`), filled with
``os.preadv`` (no mmap: its touched pages would count in RSS, and mapping and unmapping a
window per slab took more CPU here than the copy into the buffer), plus float arrays of a
smaller slab when values are decoded.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

from ..metadata import dtype_info
from .expected import Expected, OpenChunk, open_chunk

SLAB_BYTES = 1 << 20  # output bytes per slab when bytes are compared (two buffers of this per thread)
ROUND_SLAB_BYTES = 64 << 10  # smaller when values are decoded to float64 for the rounding check
_MEMCMP = ctypes.CDLL(None).memcmp
_MEMCMP.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_MEMCMP.restype = ctypes.c_int


class SlabBuffers:
    """One thread's two reusable slab buffers (output, source) and their addresses for ``memcmp``."""

    def __init__(self, nbytes: int = SLAB_BYTES) -> None:
        self.out, self.src = bytearray(nbytes), bytearray(nbytes)
        # never resized, so the addresses stay valid for the buffers' lifetime
        self.out_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.out))
        self.src_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.src))


@dataclass
class TensorCheck:
    """The value comparison of one tensor."""

    equal: bool  # no difference found in what was compared
    check: str  # "bytes", "rounding" or "average"
    checksum: str  # of the whole tensor; "" unless every slab was read (and matched)
    first_bad: int | None  # flat element index of the first difference
    fraction: float  # of the tensor's bytes compared (1.0 in full mode)
    chunks: int  # distinct chunks compared (each replica listing points at the same bytes)
    listed: int  # chunks as .metadata lists them, replicas included
    decoded_by_torch: bool  # some chunk needed DCP's decoder (stream transform, strides)


def compare_tensor(e: Expected, offset: int, fd: int, name: str, bufs: SlabBuffers,
                   every: int = 1) -> TensorCheck:
    """Compare one output tensor (at ``offset`` in ``fd``, the file ``name``) with its source chunks.

    Args:
        e: The tensor as the checkpoint says it should be.
        offset: Where its data starts in the output file, as the file's header says.
        fd: The output file, open for reading.
        name: The output file's name, for messages.
        bufs: This thread's slab buffers, reused across calls.
        every: Compare every slab (1, full mode) or, in fast mode, one slab in ``every`` (at a
            phase taken from the name), plus, from the others, each row where a chunk starts or
            ends (its boundary); a tensor of one slab is compared whole.

    Returns:
        What was compared and whether it matched, with the checksum of the output bytes.
    """
    import xxhash

    opened: list[list[OpenChunk]] = []
    try:
        for _fqn, dt, chunks in e.sources:
            opened.append([])
            for c in chunks:
                opened[-1].append(open_chunk(c, dt, dtype_info(dt)[1]))
        kind = "average" if e.weights else ("bytes" if e.sources[-1][1] == e.dtype else "rounding")
        if e.weights and e.sources[-1][1] not in _FLOATS:
            kind, opened = "bytes", opened[-1:]  # integer tensors come from the last step
        digest = xxhash.xxh3_128()
        first_bad, fraction, hashed = _walk(e, offset, fd, name, kind, opened, digest, bufs, every)
        flat = [o for per in opened for o in per]
        whole = first_bad is None and fraction == 1.0 and hashed
        return TensorCheck(first_bad is None, kind, digest.hexdigest() if whole else "", first_bad, fraction, len(flat),
                           sum(o.box.listed for o in flat), any(o.decoded_by_torch for o in flat))
    finally:
        for per in opened:
            for o in per:
                o.close()

def _walk(e: Expected, offset: int, fd: int, name: str, kind: str, opened: list[list[OpenChunk]],
          digest: Any, bufs: SlabBuffers, every: int) -> tuple[int | None, float, bool]:
    """Read the output slab by slab, in order; place and compare the chunks on each (a sample of slabs in fast mode).

    Returns:
        The flat index of the first wrong element (the walk stops at the first wrong slab) or
        None, the fraction of the tensor compared, and whether every slab went through ``digest``.
    """
    out_item = dtype_info(e.dtype)[1]
    in_dtypes = [dt for _f, dt, _c in e.sources][-len(opened):]
    shape = e.shape or (1,)
    slab = SLAB_BYTES if kind == "bytes" else ROUND_SLAB_BYTES
    compared = 0
    phase = zlib.crc32(e.name.encode()) % every  # which slabs of this tensor are in the fixed fraction
    slabs = list(_slabs(shape, out_item, slab))
    whole = every == 1 or len(slabs) <= 1  # else the checksum is not reported: do not compute it
    for base, lead, lo_j, hi_j, j in _chosen(slabs, every, phase, opened, shape, e):
        box = (hi_j - lo_j,) + shape[j + 1:]
        n_out = _numel(box) * out_item
        compared += _numel(box)
        raw = _read(fd, offset + base * out_item, n_out, name, bufs.out)
        if whole:
            digest.update(raw)
        at = _in_source(e, lead, lo_j, hi_j, j)[:4]  # the same slab, in the source tensor's coordinates
        if kind == "bytes":
            bad = _bytes_differ(box, out_item, opened[-1], *at, bufs)
        else:
            bad = _values_differ(e, kind, raw, box, out_item, opened, in_dtypes, *at, bufs)
        if bad is not None:
            return base + bad, compared / max(1, _numel(shape)), False  # the tensor is wrong; no checksum needed
    return None, compared / _numel(shape) if _numel(shape) else 1.0, whole


def _bytes_differ(box: tuple[int, ...], item: int, chunks: list[OpenChunk], lead: tuple[int, ...], lo_j: int,
                  hi_j: int, j: int, bufs: SlabBuffers) -> int | None:
    """Flat index in the slab's box of the first element where a chunk's bytes differ from the output's (None: equal)."""
    first: int | None = None
    for oc in chunks:
        piece = _piece(oc, lead, lo_j, hi_j, j, item, bufs)
        if piece is None:
            continue
        starts, sizes = piece
        for o, src, n in region_runs(box, starts, sizes):
            if _MEMCMP(bufs.out_addr + o * item, bufs.src_addr + src * item, n * item) != 0:
                at = o + _first_byte_diff(bufs.out, o * item, bufs.src, src * item, n * item) // item
                first = at if first is None else min(first, at)
                break  # runs come in the box's order: the first bad run of a chunk holds its first difference
    return first


def _values_differ(e: Expected, kind: str, raw: memoryview, box: tuple[int, ...], out_item: int,
                   opened: list[list[OpenChunk]], in_dtypes: list[str], lead: tuple[int, ...], lo_j: int, hi_j: int,
                   j: int, bufs: SlabBuffers) -> int | None:
    """Rounding and averaging: decode the values, place them with numpy slicing, check the rounding.

    Returns:
        The flat index in the slab's box of the first badly rounded element, or None.
    """
    import numpy as np  # only here: a cast or an average (whose writer imports numpy too)

    from .rounding import badly_rounded, decode, patterns

    out = np.frombuffer(raw, np.uint8).reshape(box + (out_item,))
    acc = np.zeros(box, np.float64 if kind == "rounding" else np.float32)
    for i, chunks in enumerate(opened):
        in_item = dtype_info(in_dtypes[i])[1]
        for oc in chunks:
            piece = _piece(oc, lead, lo_j, hi_j, j, in_item, bufs)
            if piece is None:
                continue
            starts, sizes = piece
            src = np.frombuffer(bufs.src, np.uint8, _numel(sizes) * in_item).reshape(sizes + (in_item,))
            region = tuple(slice(a, a + n) for a, n in zip(starts, sizes))
            if kind == "rounding":
                acc[region] = decode(patterns(src, in_dtypes[i])[..., 0], in_dtypes[i])
            else:
                vals = decode(patterns(src, in_dtypes[i])[..., 0], in_dtypes[i]).astype(np.float32)
                acc[region] += np.float32(e.weights[i]) * vals  # type: ignore[index]
    bad = badly_rounded(acc.astype(np.float64), patterns(out, e.dtype).reshape(box), e.dtype)
    return int(bad[0]) if len(bad) else None


def region_runs(box: tuple[int, ...], starts: tuple[int, ...],
                sizes: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """The box ``out[s0:s0+n0, s1:s1+n1, ...]`` of a row-major array of shape ``box``, as contiguous runs.

    Yields ``(first element in the array, first element in the box's own row-major data,
    elements)`` in the array's order. Trailing dimensions the box covers whole are merged
    into one run, so a chunk of whole rows is a single run. (Equivalent to numpy's basic
    slicing; ``tests/consolidate/test_compare_runs.py`` checks it against numpy on random boxes.)
    """
    n = len(box)
    k = n - 1
    while k > 0 and starts[k] == 0 and sizes[k] == box[k]:
        k -= 1
    run = sizes[k] * _numel(box[k + 1:])
    if run == 0:
        return
    out_strides = [_numel(box[d + 1:]) for d in range(n)]
    box_strides = [_numel(sizes[d + 1:]) for d in range(n)]
    corner = starts[k] * out_strides[k]
    for idx in itertools.product(*(range(z) for z in sizes[:k])):
        yield (corner + sum((starts[d] + i) * out_strides[d] for d, i in enumerate(idx)),
               sum(i * box_strides[d] for d, i in enumerate(idx)), run)


def _first_byte_diff(a: bytearray, a_off: int, b: bytearray, b_off: int, n: int) -> int:
    """Offset of the first differing byte of two ranges known to differ (a failure's message only)."""
    step = 4096
    for at in range(0, n, step):
        m = min(step, n - at)
        if a[a_off + at:a_off + at + m] != b[b_off + at:b_off + at + m]:
            return at + next(i for i in range(m) if a[a_off + at + i] != b[b_off + at + i])
    return 0


def _in_source(e: Expected, lead: tuple[int, ...], lo_j: int, hi_j: int,
               j: int) -> tuple[tuple[int, ...], int, int, int, int]:
    """An output slab ``(lead, lo_j:hi_j on j)`` in the source tensor's coordinates, and the shift of dim ``j``.

    An output tensor cut from a fused one (``e.index``, ``e.rows``: an expert) is
    ``source[index..., rows[0] + r, ...]``: its dimension 0 is the source's ``len(index)``,
    shifted by ``rows[0]``; later dimensions are the source's own. Chunk boxes stay in the
    source's coordinates, so they are placed exactly as for a tensor written whole.
    """
    if not e.index and e.rows is None:
        return lead, lo_j, hi_j, j, 0
    k, shift = len(e.index), e.rows[0] if e.rows else 0
    if j == 0:
        return e.index, lo_j + shift, hi_j + shift, k, shift
    return e.index + (lead[0] + shift,) + lead[1:], lo_j, hi_j, j + k, 0


def _chosen(slabs: list[tuple[int, tuple[int, ...], int, int, int]], every: int, phase: int,
            opened: list[list[OpenChunk]], shape: tuple[int, ...],
            e: Expected) -> Iterator[tuple[int, tuple[int, ...], int, int, int]]:
    """The slabs to compare: all of them (``every`` 1, or a tensor of one slab); in fast mode the
    slabs ``i`` with ``(i + phase) % every == 0`` (a fixed fraction over the model, the phase
    spreading it over small tensors too), and from each other slab only the rows where a chunk
    starts or ends (its boundaries)."""
    for index, (base, lead, lo_j, hi_j, j) in enumerate(slabs):
        if every == 1 or len(slabs) == 1 or (index + phase) % every == 0:
            yield base, lead, lo_j, hi_j, j
            continue
        src_lead, src_lo, src_hi, src_j, shift = _in_source(e, lead, lo_j, hi_j, j)
        rows = _boundary_rows(opened, src_lead, src_lo, src_hi, src_j, len(e.index))
        if rows is None:
            yield base, lead, lo_j, hi_j, j
            continue
        inner = _numel(shape[j + 1:])
        for r in sorted(x - shift for x in rows):
            yield base + (r - lo_j) * inner, lead, r, r + 1, j


def _boundary_rows(opened: list[list[OpenChunk]], lead: tuple[int, ...], lo_j: int, hi_j: int, j: int,
                   cut: int = 0) -> set[int] | None:
    """Indices along ``j`` in ``[lo_j, hi_j)`` where a chunk meeting the slab starts or ends; None: the whole slab.

    Dimensions after ``j`` are whole in every slab, so their chunk edges are in every row
    compared; a fixed index before ``j`` at a chunk's edge makes the whole slab a boundary,
    except the first ``cut`` ones: those select the output from a fused tensor (an expert,
    which lies whole in its chunk), so an edge there is no edge of the output.
    """
    rows: set[int] = set()
    for chunks in opened:
        for oc in chunks:
            offs, sizes = oc.box.offsets or (0,), oc.box.sizes or (1,)
            if any(not (o <= i < o + s) for i, o, s in zip(lead, offs, sizes)):
                continue
            if any(i in (o, o + s - 1) for i, o, s in list(zip(lead, offs, sizes))[cut:]):
                return None
            rows.update(r for r in (offs[j], offs[j] + sizes[j] - 1) if lo_j <= r < hi_j)
    return rows


_FLOATS = ("float64", "float32", "float16", "bfloat16")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _slabs(shape: tuple[int, ...], item: int, slab: int) -> Iterator[tuple[int, tuple[int, ...], int, int, int]]:
    """Contiguous slabs of a row-major tensor, as (first element, fixed leading indices, lo, hi on dim j, j).

    ``j`` is the first dimension whose trailing block fits a slab: indices before it are
    fixed per slab, a range of it is taken, and every later dimension whole.
    """
    n = len(shape)
    if _numel(shape) == 0:
        return
    j = 0
    while j < n - 1 and _numel(shape[j + 1:]) * item > slab:
        j += 1
    inner = _numel(shape[j + 1:])
    rows = max(1, slab // (inner * item))
    strides = [_numel(shape[k + 1:]) for k in range(n)]
    for lead in itertools.product(*(range(s) for s in shape[:j])):
        start = sum(i * st for i, st in zip(lead, strides))
        for lo in range(0, shape[j], rows):
            yield start + lo * strides[j], lead, lo, min(shape[j], lo + rows), j


def _piece(oc: OpenChunk, lead: tuple[int, ...], lo_j: int, hi_j: int, j: int, item: int,
           bufs: SlabBuffers) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The chunk's part of the slab, read into ``bufs.src``: where it goes in the slab's box (starts, sizes), or None.

    The part is the chunk's rows ``lo..hi`` along ``j`` with all its later dimensions, which
    are contiguous in the chunk.
    """
    offs, sizes = oc.box.offsets or (0,), oc.box.sizes or (1,)
    if any(not (o <= i < o + s) for i, o, s in zip(lead, offs, sizes)):
        return None
    lo, hi = max(lo_j, offs[j]), min(hi_j, offs[j] + sizes[j])
    if lo >= hi:
        return None
    local = [i - o for i, o in zip(lead, offs)] + [lo - offs[j]]
    strides = [_numel(sizes[k + 1:]) for k in range(len(sizes))]
    start = sum(i * st for i, st in zip(local, strides))
    count = (hi - lo) * strides[j]
    if oc.mem is not None:
        bufs.src[:count * item] = oc.mem[start * item:(start + count) * item]
    else:
        _read(oc.fd, oc.data_start + start * item, count * item, str(oc.box.file), bufs.src)
    return (lo - lo_j,) + tuple(offs[j + 1:]), (hi - lo,) + tuple(sizes[j + 1:])


def _read(fd: int, off: int, n: int, name: str, buf: bytearray) -> memoryview:
    """``n`` bytes of ``fd`` at ``off``, read into ``buf`` (a reused slab buffer); a view of them."""
    mv, done = memoryview(buf)[:n], 0
    while done < n:
        got = os.preadv(fd, [mv[done:]], off + done)
        if got == 0:
            raise OSError(f"{name}: ends before offset {off + n} while verifying")
        done += got
    return mv
