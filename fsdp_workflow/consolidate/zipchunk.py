"""Locate a tensor's raw bytes inside a torch.save zip archive, without torch.

Each DCP chunk in a ``.distcp`` file is a complete ``torch.save`` archive stored at
(offset, length). torch writes its entries uncompressed, with the tensor bytes 64-byte
aligned in ``<prefix>/data/<key>``; the local headers use data descriptors, so sizes are
taken from the central directory at the end of the archive.

Parsing the headers here (rather than :mod:`zipfile`) is the point: it yields the absolute
byte offset of the tensor data inside the shard file, which the writer then reads with
``preadv`` straight into its output buffers. A whole member that is only read once
(``meta.pt``'s ``data.pkl``) goes through :mod:`zipfile` instead (:mod:`.metadata`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from .consolidation_errors import ConsolidationError
from .metadata import TensorRef, dtype_info, restricted_loads

_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_CDIR = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_TAIL_READ = 8192
_HEAD_READ = 4096


@dataclass
class ZipEntry:
    """One central-directory record: where the member's local header is, and its size."""

    name: str
    header_offset: int
    size: int
    method: int


@dataclass
class ChunkData:
    """Where a chunk's contiguous bytes are, relative to the start of its file."""

    data_offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    contiguous: bool


def _pread(fd: int, n: int, off: int, source: str) -> bytes:
    buf = os.pread(fd, n, off)
    if len(buf) != n:
        raise ConsolidationError(f"{source}: truncated (wanted {n} bytes at offset {off}, got {len(buf)}); the shard file is incomplete")
    return buf


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int]:
    """Apply a zip64 extra field: its values replace the 0xFFFFFFFF placeholders, in order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            vals = list(struct.unpack_from(f"<{ln // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                vals.pop(0)
            if offset == 0xFFFFFFFF and vals:
                offset = vals.pop(0)
        pos += 4 + ln
    return usize, offset


def list_entries(fd: int, base: int, length: int, source: str) -> tuple[list[ZipEntry], bytes]:
    """Parse the central directory of the archive at ``[base, base+length)``.

    Returns the entries and the first bytes of the archive (which usually hold data.pkl).
    """
    tail_n = min(length, _TAIL_READ)
    tail = _pread(fd, tail_n, base + length - tail_n, source)
    pos = tail.rfind(_EOCD)
    if pos < 0:
        raise ConsolidationError(f"{source}: no zip end record in chunk at offset {base}; the shard is truncated or not a torch.save archive")
    n_entries, cd_size, cd_off = struct.unpack_from("<10xHII", tail, pos)
    loc = tail.rfind(_EOCD64_LOC, 0, pos)
    if loc >= 0 and (cd_off == 0xFFFFFFFF or n_entries == 0xFFFF):
        (eocd64_off,) = struct.unpack_from("<8xQ", tail, loc)
        rec = _pread(fd, 56, base + eocd64_off, source)
        n_entries, cd_size, cd_off = struct.unpack_from("<32xQQQ", rec)
    if cd_off + cd_size > length:
        raise ConsolidationError(f"{source}: zip directory points past the chunk at offset {base}; the shard is corrupt")
    rel = cd_off - (length - tail_n)
    cdir = tail[rel : rel + cd_size] if rel >= 0 else _pread(fd, cd_size, base + cd_off, source)
    entries: list[ZipEntry] = []
    p = 0
    for _ in range(n_entries):
        if cdir[p : p + 4] != _CDIR:
            raise ConsolidationError(f"{source}: bad zip directory entry in chunk at offset {base}")
        method, csize, usize, nlen, elen, clen, hoff = struct.unpack_from("<10xH8xIIHHH8xI", cdir, p)
        name = cdir[p + 46 : p + 46 + nlen].decode("utf-8")
        usize, hoff = _zip64_extra(cdir[p + 46 + nlen : p + 46 + nlen + elen], usize, csize, hoff)
        entries.append(ZipEntry(name, hoff, usize, method))
        p += 46 + nlen + elen + clen
    head = _pread(fd, min(length, _HEAD_READ), base, source)
    return entries, head


def _entry_data_offset(fd: int, base: int, entry: ZipEntry, head: bytes, source: str) -> int:
    hdr = head[entry.header_offset : entry.header_offset + 30]
    if len(hdr) < 30:
        hdr = _pread(fd, 30, base + entry.header_offset, source)
    if hdr[:4] != _LOCAL:
        raise ConsolidationError(f"{source}: bad zip local header for {entry.name} in chunk at offset {base}")
    nlen, elen = struct.unpack_from("<26xHH", hdr)
    return entry.header_offset + 30 + nlen + elen


def _entry_bytes(fd: int, base: int, entry: ZipEntry, head: bytes, source: str) -> bytes:
    start = _entry_data_offset(fd, base, entry, head, source)
    if start + entry.size <= len(head):
        return head[start : start + entry.size]
    return _pread(fd, entry.size, base + start, source)


def locate_chunk(fd: int, base: int, length: int, source: str) -> ChunkData:
    """Find the raw tensor bytes of the torch.save archive at ``[base, base+length)``."""
    entries, head = list_entries(fd, base, length, source)
    by_suffix = {e.name.split("/", 1)[-1]: e for e in entries}
    if "data.pkl" not in by_suffix:
        raise ConsolidationError(f"{source}: chunk at offset {base} has no data.pkl; not a torch.save archive")
    order = by_suffix.get("byteorder")
    if order is not None and _entry_bytes(fd, base, order, head, source) != b"little":
        raise ConsolidationError(f"{source}: big-endian checkpoints are not supported")
    ref = restricted_loads(_entry_bytes(fd, base, by_suffix["data.pkl"], head, source), f"{source}@{base}/data.pkl")
    if not isinstance(ref, TensorRef):
        raise ConsolidationError(f"{source}: chunk at offset {base} does not hold a single tensor (found {type(ref).__name__})")
    entry = by_suffix.get(f"data/{ref.storage.key}")
    if entry is None or entry.method != 0:
        raise ConsolidationError(f"{source}: chunk at offset {base} lacks an uncompressed data/{ref.storage.key} entry")
    itemsize = dtype_info(ref.storage.dtype)[1]
    numel = 1
    for s in ref.shape:
        numel *= s
    contiguous = ref.stride == _contiguous_strides(ref.shape) or numel <= 1
    start = _entry_data_offset(fd, base, entry, head, source) + ref.storage_offset * itemsize
    nbytes = numel * itemsize
    if start + nbytes > length or (ref.storage_offset + numel) * itemsize > entry.size:
        raise ConsolidationError(f"{source}: tensor bytes of chunk at offset {base} run past its archive; the shard is corrupt")
    return ChunkData(base + start, nbytes, ref.storage.dtype, ref.shape, contiguous)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))

