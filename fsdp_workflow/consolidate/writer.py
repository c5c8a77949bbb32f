"""Streaming safetensors writer: headers from metadata first, then bytes copied into place.

Every output file is laid out before any tensor data is read: the JSON header is computed
from the DCP metadata, the file is sized with ``ftruncate``, and worker threads copy each
chunk's byte ranges to their final offsets (``copy_file_range`` in-kernel when the dtype is
kept, small bounded buffers otherwise). Right after a tensor is written the same worker
re-reads it, hashes it and compares it with the source chunks, so verification overlaps
the copy. Memory stays at a few buffers per worker whatever the model size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .average import accumulate
from .casting import cast_bytes
from .metadata import dtype_info
from .reader import ChunkHandle, SourceTensor, chunk_runs

SLAB_BYTES = 8 << 20  # read/compare buffer per worker
BIG_RUN_BYTES = 256 << 10  # runs at least this long are copied in-kernel
_COPY_FILE_RANGE = hasattr(os, "copy_file_range")


@dataclass
class OutTensor:
    """One tensor of the output, with the source tensor(s) it comes from."""

    name: str
    sources: list[SourceTensor]
    dtype: str
    weights: list[float] | None = None
    file_index: int = 0
    offset: int = 0  # absolute offset of the data in its file

    @property
    def shape(self) -> tuple:
        return self.sources[0].shape

    @property
    def nbytes(self) -> int:
        return self.sources[0].numel * dtype_info(self.dtype)[1]


@dataclass
class TensorReport:
    sha256: str
    equal_to_source: bool | None
    first_mismatch: int | None = None


@dataclass
class OutFile:
    name: str
    tensors: list[OutTensor] = field(default_factory=list)
    header: bytes = b""
    size: int = 0


def parse_size(value: str | int) -> int:
    """Parse ``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int (bytes), as transformers does."""
    if isinstance(value, int):
        return value
    s = value.strip().upper()
    units = [("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)]
    for suffix, mult in units:
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def plan_files(tensors: list[OutTensor], max_shard_bytes: int) -> list[OutFile]:
    """Split tensors into safetensors files (greedy, like ``save_pretrained``) and lay out headers."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    files = []
    for i, group in enumerate(groups):
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        # Larger items first keeps every tensor aligned to its element size.
        ordered = sorted(group, key=lambda t: -dtype_info(t.dtype)[1])
        header: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        for t in ordered:
            header[t.name] = {"dtype": dtype_info(t.dtype)[0], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % 8)
        hdr = len(raw).to_bytes(8, "little") + raw
        for t in group:
            t.file_index = i
            t.offset = len(hdr) + header[t.name]["data_offsets"][0]
        files.append(OutFile(name, group, hdr, len(hdr) + pos))
    return files


def _pwrite_all(fd: int, data: memoryview | bytes, off: int) -> None:
    mv = memoryview(data)
    while mv:
        n = os.pwrite(fd, mv, off)
        mv, off = mv[n:], off + n


def _copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    global _COPY_FILE_RANGE
    while n > 0 and _COPY_FILE_RANGE:
        try:
            done = os.copy_file_range(src_fd, dst_fd, n, src_off, dst_off)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                _COPY_FILE_RANGE = False
                break
            raise
        if done == 0:
            raise OSError(errno.EIO, "copy_file_range hit end of file (shard truncated?)")
        src_off, dst_off, n = src_off + done, dst_off + done, n - done
    while n > 0:
        buf = os.pread(src_fd, min(n, SLAB_BYTES), src_off)
        if not buf:
            raise OSError(errno.EIO, "unexpected end of shard file")
        _pwrite_all(dst_fd, buf, dst_off)
        src_off, dst_off, n = src_off + len(buf), dst_off + len(buf), n - len(buf)


def _pieces(runs: list[tuple[int, int, int]], max_elems: int) -> list[list[tuple[int, int, int]]]:
    """Group consecutive runs into batches of at most ``max_elems``, splitting long runs."""
    batches: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for src, dst, n in runs:
        i = 0
        while i < n:
            take = min(n - i, max_elems)
            if batches[-1] and size + take > max_elems:
                batches.append([])
                size = 0
            batches[-1].append((src + i, dst + i, take))
            size += take
            i += take
    return [b for b in batches if b]


class StreamingWriter:
    """Write planned files into ``out_dir``; report per-tensor checksums and equality.

    Args:
        out_dir: Directory to write into (the temporary sibling of the final output).
        files: Result of :func:`plan_files`.
        workers: Threads doing copy + verification.
        on_bytes: Progress callback, called with bytes written.
        verify: Re-read, hash and compare every tensor after writing it.
    """

    def __init__(self, out_dir: Path, files: list[OutFile], workers: int = 4,
                 on_bytes: Callable[[int], object] | None = None, verify: bool = True) -> None:
        self.out_dir = out_dir
        self.files = files
        self.workers = workers
        self.verify = verify
        self._lock = threading.Lock()
        self._callback = on_bytes

    def on_bytes(self, n: int) -> None:
        if self._callback is not None:
            with self._lock:
                self._callback(n)

    def run(self) -> dict[str, TensorReport]:
        fds = []
        try:
            for f in self.files:
                fd = os.open(self.out_dir / f.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                os.ftruncate(fd, f.size)
                _pwrite_all(fd, f.header, 0)
            jobs = [t for f in self.files for t in f.tensors]
            jobs.sort(key=lambda t: -t.nbytes)  # big first balances the threads
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                results = list(pool.map(lambda t: self._one(fds[t.file_index], t), jobs))
            return {t.name: r for t, r in zip(jobs, results)}
        finally:
            for fd in fds:
                os.close(fd)

    def _one(self, fd: int, t: OutTensor) -> TensorReport:
        if len(t.sources) > 1 or t.weights:
            data = accumulate(t.sources, t.weights or [1.0], t.dtype)
            _pwrite_all(fd, data, t.offset)
            self.on_bytes(len(data))
            return TensorReport(hashlib.sha256(data).hexdigest() if self.verify else "", None)
        src = t.sources[0]
        handles = [ChunkHandle(c, src.dtype) for c in src.chunks]
        try:
            for h in handles:
                self._copy_chunk(fd, t, src, h)
            return self._verify(fd, t, src, handles) if self.verify else TensorReport("", None)
        finally:
            for h in handles:
                h.close()

    def _copy_chunk(self, fd: int, t: OutTensor, src: SourceTensor, h: ChunkHandle) -> None:
        in_item, out_item = dtype_info(src.dtype)[1], dtype_info(t.dtype)[1]
        runs = chunk_runs(src.shape, h.chunk)
        cast = src.dtype != t.dtype
        if not cast and h.raw_offset is not None and runs and (len(runs) == 1 or runs[0][2] * in_item >= BIG_RUN_BYTES):
            for s, d, n in runs:
                _copy_range(h.fd, fd, h.raw_offset + s * in_item, t.offset + d * out_item, n * in_item)
                self.on_bytes(n * out_item)
            return
        for batch in _pieces(runs, SLAB_BYTES // max(in_item, out_item)):
            first = batch[0][0]
            end = batch[-1][0] + batch[-1][2]
            buf = h.read(first * in_item, (end - first) * in_item)
            if cast:
                buf = cast_bytes(buf, src.dtype, t.dtype)
            mv = memoryview(buf)
            for s, d, n in batch:
                a = (s - first) * out_item
                _pwrite_all(fd, mv[a : a + n * out_item], t.offset + d * out_item)
            self.on_bytes((end - first) * out_item)

    def _verify(self, fd: int, t: OutTensor, src: SourceTensor, handles: list[ChunkHandle]) -> TensorReport:
        """Hash the written tensor in output order and compare it with the (cast) source bytes."""
        in_item, out_item = dtype_info(src.dtype)[1], dtype_info(t.dtype)[1]
        runs = sorted(((d, s, n, h) for h in handles for s, d, n in chunk_runs(src.shape, h.chunk)), key=lambda r: r[0])
        digest = hashlib.sha256()
        step = SLAB_BYTES // max(in_item, out_item)
        equal, mismatch = True, None
        for d, s, n, h in runs:
            for i in range(0, n, step):
                k = min(step, n - i)
                got = os.pread(fd, k * out_item, t.offset + (d + i) * out_item)
                digest.update(got)
                want = h.read((s + i) * in_item, k * in_item)
                if src.dtype != t.dtype:
                    want = cast_bytes(want, src.dtype, t.dtype)
                if equal and not _same(got, want):
                    equal, mismatch = False, d + i
        return TensorReport(digest.hexdigest(), equal, mismatch)


def _same(a: bytes, b: bytes) -> bool:
    """Fast byte equality (numpy compares 8 bytes at a time; ``bytes ==`` is far slower here)."""
    if len(a) != len(b):
        return False
    n8 = len(a) // 8
    return bool(np.array_equal(np.frombuffer(a, np.uint64, n8), np.frombuffer(b, np.uint64, n8))) and a[n8 * 8 :] == b[n8 * 8 :]


def source_digest(src: SourceTensor) -> str:
    """sha256 of a source tensor's bytes in row-major order (used to compare tied weights)."""
    handles = [ChunkHandle(c, src.dtype) for c in src.chunks]
    try:
        item = dtype_info(src.dtype)[1]
        runs = sorted(((d, s, n, h) for h in handles for s, d, n in chunk_runs(src.shape, h.chunk)), key=lambda r: r[0])
        digest = hashlib.sha256()
        step = SLAB_BYTES // item
        for _d, s, n, h in runs:
            for i in range(0, n, step):
                digest.update(h.read((s + i) * item, min(step, n - i) * item))
        return digest.hexdigest()
    finally:
        for h in handles:
            h.close()
