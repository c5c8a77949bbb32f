"""The verifier's placement of a chunk's box (``verify.values.region_runs``) against numpy's slicing.

The default (bytes) comparison walks a chunk's box in the output slab as contiguous runs
instead of numpy slicing (numpy's import was a large part of its cost); these tests hold the
runs to what ``out[s0:s0+n0, s1:s1+n1, ...]`` means, on random boxes of 1 to 4 dimensions.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from fsdp_workflow.consolidate.verify.expected import OpenChunk, SrcChunk
from fsdp_workflow.consolidate.verify.values import SlabBuffers, _bytes_differ, region_runs


def _gather(box, starts, sizes):
    """The box's elements of ``arange`` in row-major order, through region_runs."""
    flat = np.arange(int(np.prod(box)))
    got, src_next = [], 0
    for out_at, src_at, n in region_runs(box, starts, sizes):
        assert src_at == src_next, "the box's own data must be consumed in order, without gaps"
        got.extend(flat[out_at:out_at + n])
        src_next += n
    return np.array(got, dtype=flat.dtype), flat


@pytest.mark.parametrize("seed", range(200))
def test_region_runs_select_what_numpy_slicing_selects(seed):
    rng = random.Random(seed)
    box = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
    starts = tuple(rng.randint(0, d - 1) for d in box)
    sizes = tuple(rng.randint(1, d - s) for d, s in zip(box, starts))
    got, flat = _gather(box, starts, sizes)
    want = flat.reshape(box)[tuple(slice(s, s + n) for s, n in zip(starts, sizes))].ravel()
    assert got.tolist() == want.tolist()


def test_whole_rows_are_one_run_and_a_column_band_is_one_run_per_row():
    assert list(region_runs((4, 8), (1, 0), (2, 8))) == [(8, 0, 16)]
    assert list(region_runs((3, 8), (0, 2), (3, 4))) == [(2, 0, 4), (10, 4, 4), (18, 8, 4)]
    assert list(region_runs((5,), (2,), (3,))) == [(2, 0, 3)]
    assert list(region_runs((2, 0), (0, 0), (2, 0))) == []


def test_a_chunk_differing_in_its_second_column_band_is_found_at_its_first_wrong_element(tmp_path):
    # a 4 x 6 uint8 tensor split along dim 1 into two 4 x 3 chunks; the output slab holds all of it
    full = np.arange(24, dtype=np.uint8).reshape(4, 6)
    path = tmp_path / "chunks.bin"
    left, right = np.ascontiguousarray(full[:, :3]), np.ascontiguousarray(full[:, 3:])
    right_bad = right.copy()
    right_bad[2, 1] ^= 0xFF  # element (2, 4) of the tensor: flat index 16
    path.write_bytes(left.tobytes() + right_bad.tobytes())
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [OpenChunk(SrcChunk((0, 0), (4, 3), path, 0, 12, ()), fd, data_start=0),
                  OpenChunk(SrcChunk((0, 3), (4, 3), path, 12, 12, ()), fd, data_start=12)]
        bufs = SlabBuffers(64)
        bufs.out[:24] = full.tobytes()
        assert _bytes_differ((4, 6), 1, chunks, (), 0, 4, 0, bufs) == 16
        assert _bytes_differ((4, 6), 1, chunks[:1], (), 0, 4, 0, bufs) is None
    finally:
        os.close(fd)
