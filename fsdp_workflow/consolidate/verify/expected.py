"""What the output should hold, derived from the checkpoint again, apart from the writer.

The verifier (:mod:`.verifier`) must catch the writer's own mistakes: a chunk at the wrong
place, a wrong rename, a cast applied to the wrong tensor. So nothing here comes from the
writer's plan (:class:`~fsdp_workflow.consolidate.writer.OutTensor`) or its chunk arithmetic (``reader.chunk_runs``,
``zipchunk.locate_chunk``):

* tensor names: ``.metadata`` is read again and every key renamed by calling the key-hygiene
  rule (:func:`~fsdp_workflow.consolidate.key_names.map_keys`) directly; the tied-embedding rule and
  the saved layout of MoE experts (:func:`~fsdp_workflow.consolidate.hub_layout.hub_pieces`: which
  box of which source tensor each expert is) likewise;
* chunks: every chunk ``.metadata`` lists (replicas too), with its storage item;
* chunk bytes: each item's ``torch.save`` archive is opened with the standard library's
  :mod:`zipfile` over a window of the shard file, which finds ``data/<key>``; ``data.pkl``
  (through the project's one unpickling allow-list) gives dtype, shape, storage offset and
  strides. Items that need decoding (stream transforms such as zstd, non-contiguous
  strides) are decoded by DCP's own reader, the one decoding path there is; their
  placement is still checked here.

DeepSpeed sources have no ``.metadata``: their tensors are the fp32 masters rebuilt from the
ZeRO partitions (:mod:`fsdp_workflow.consolidate.deepspeed`), and the output is compared with that rebuild.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_workflow.core.rundir import DCP_METADATA

from ..casting import FLOAT_NAMES
from ..consolidation_errors import ConsolidationError
from ..hub_layout import hub_pieces
from ..key_names import map_keys, tied_pair
from ..metadata import TensorRef, TensorStorageMetadata, dtype_info, load_dcp_metadata, restricted_loads
from ..reader import Chunk, DcpCheckpoint, _torch_load_chunk
from ..source import Source

Box = tuple[int, ...]


@dataclass
class SrcChunk:
    """One chunk as ``.metadata`` lists it: its box in the tensor and its storage item."""

    offsets: Box
    sizes: Box
    file: Path
    offset: int
    length: int
    transforms: tuple[str, ...]
    listed: int = 1  # how many times .metadata lists this box (replicas)
    # Where its plain bytes start in the file, once located: the experts cut from one chunk share it
    data_start: int | None = None


@dataclass
class Expected:
    """One output tensor as the checkpoint says it should be."""

    name: str
    dtype: str  # output dtype
    shape: Box
    sources: list[tuple[str, str, list[SrcChunk]]]  # per checkpoint: (fqn, stored dtype, chunks meeting the box)
    weights: list[float] | None = None  # averaging weights, normalised
    # A box of the source (an expert of a fused MoE tensor, :mod:`..hub_layout`): source[index..., rows, ...]
    index: Box = ()
    rows: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        n = dtype_info(self.dtype)[1]
        for s in self.shape:
            n *= s
        return n


@dataclass
class ExpectedModel:
    tensors: dict[str, Expected]
    dropped: str | None  # tied output embedding left out
    notes: list[str] = field(default_factory=list)


def expected_model(source: Source, out_dtype: str | None, weights: list[float] | None) -> ExpectedModel:
    """Every output tensor's name, dtype, shape and source chunks, read from the checkpoints again.

    Raises:
        ConsolidationError: a tensor's chunks overlap, leave a gap or fall outside it.
    """
    per_ckpt = [_tensors_of(c) for c in source.checkpoints]
    archs = source.reference.architectures if source.reference else []
    causal = (not archs) or any(a.endswith("ForCausalLM") for a in archs)
    maps = [map_keys(list(t), source.subtree_key, causal) for t in per_ckpt]
    newest, m_last = per_ckpt[-1], maps[-1]
    config = source.reference.config if source.reference else None
    tied = tied_pair(list(m_last), config, {n: source.checkpoints[-1].tensors[f] for n, f in m_last.items()})
    dropped = tied.dropped if tied else None
    if len(per_ckpt) > 1 or weights:
        total = float(sum(weights)) if weights else float(len(per_ckpt))
        norm = [w / total for w in weights] if weights else [1.0 / len(per_ckpt)] * len(per_ckpt)
    # The saved names of fused MoE experts: the naming rule the planner calls too (like map_keys)
    layout = hub_pieces({n: newest[f][1] for n, f in m_last.items() if n != dropped}, config)
    tiled: set[tuple[int, str]] = set()
    out: dict[str, Expected] = {}
    for p in layout.pieces:
        stored = newest[m_last[p.source]][0]
        srcs = []
        for i, (tensors, m) in enumerate(zip(per_ckpt, maps)):
            fqn = m[p.source]
            dt, sh, chunks = tensors[fqn]
            if (i, fqn) not in tiled:  # once per source tensor, not per expert cut from it
                _check_tiling(p.source, sh, chunks)
                tiled.add((i, fqn))
            if not p.whole:
                chunks = [c for c in chunks if _meets(c, p.index, p.rows or (0, sh[len(p.index)]))]
            srcs.append((fqn, dt, chunks))
        dtype = out_dtype if (out_dtype and stored in FLOAT_NAMES) else stored
        out[p.name] = Expected(p.name, dtype, p.shape, srcs, norm if len(srcs) > 1 else None, p.index, p.rows)
    return ExpectedModel(out, dropped)


def _meets(c: SrcChunk, index: Box, rows: tuple[int, int]) -> bool:
    """Whether chunk ``c`` holds part of the box ``[index..., rows[0]:rows[1], ...]`` of its tensor."""
    k = len(index)
    return (all(o <= i < o + n for i, o, n in zip(index, c.offsets, c.sizes))
            and c.offsets[k] < rows[1] and rows[0] < c.offsets[k] + c.sizes[k])


def _tensors_of(ckpt: object) -> dict[str, tuple[str, Box, list[SrcChunk]]]:
    """fqn -> (dtype, shape, chunks): from ``.metadata`` for DCP, from the rebuild's index for DeepSpeed."""
    if not isinstance(ckpt, DcpCheckpoint):
        return {f: (t.dtype, t.shape, [_from_chunk(c) for c in t.chunks]) for f, t in ckpt.tensors.items()}  # type: ignore[attr-defined]
    md = load_dcp_metadata(ckpt.path / DCP_METADATA)
    storage = {(i.fqn, tuple(i.offset) if i.offset is not None else None): s for i, s in (md.storage_data or {}).items()}
    out: dict[str, tuple[str, Box, list[SrcChunk]]] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata):
            continue
        boxes: dict[Box, SrcChunk] = {}
        for c in tmd.chunks:
            offs, sizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
            if offs in boxes:
                if boxes[offs].sizes != sizes:
                    raise ConsolidationError(f"{ckpt.path}: '{fqn}' lists chunks at {offs} with sizes {boxes[offs].sizes} and {sizes}")
                boxes[offs].listed += 1
                continue
            info = storage.get((fqn, offs))
            if info is None:
                raise ConsolidationError(f"{ckpt.path}: '{fqn}' chunk at {offs} has no storage entry")
            boxes[offs] = SrcChunk(offs, sizes, ckpt.path / info.relative_path, int(info.offset), int(info.length),
                                   tuple(info.transform_descriptors or ()))
        out[fqn] = (tmd.properties.dtype.name, tuple(int(x) for x in tmd.size), list(boxes.values()))
    return out


def _from_chunk(c: Chunk) -> SrcChunk:
    return SrcChunk(tuple(c.offsets), tuple(c.sizes), c.file, c.offset, c.length, tuple(c.transforms))


def _check_tiling(name: str, shape: Box, chunks: list[SrcChunk]) -> None:
    """Chunks inside the tensor, pairwise disjoint, their volumes adding up: then they tile it."""
    total = 0
    for i, c in enumerate(chunks):
        if len(c.offsets) != len(shape) or any(o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            raise ConsolidationError(f"'{name}': chunk {list(c.offsets)}+{list(c.sizes)} lies outside the shape {list(shape)}")
        vol = 1
        for s in c.sizes:
            vol *= s
        total += vol
        for d in chunks[:i]:
            if vol and all(a < b + t and b < a + s for a, s, b, t in zip(c.offsets, c.sizes, d.offsets, d.sizes)):
                raise ConsolidationError(f"'{name}': chunks at {list(c.offsets)} and {list(d.offsets)} overlap")
    numel = 1
    for s in shape:
        numel *= s
    if total != numel:
        raise ConsolidationError(f"'{name}': chunks cover {total} of {numel} elements")


class _Window(io.RawIOBase):
    """``[base, base + length)`` of a file as a seekable file for :class:`zipfile.ZipFile`.

    Reads use ``pread`` (no shared file position between threads). The archive's first and
    last few KiB, where zipfile looks for the end record, directory, local headers and
    ``data.pkl``, are read once and served from memory: zipfile reads in many small pieces.
    """

    _EDGE = 16 << 10

    def __init__(self, fd: int, base: int, length: int) -> None:
        super().__init__()
        self.fd, self.base, self.length, self.pos = fd, base, length, 0
        self.head = os.pread(fd, min(length, self._EDGE), base)
        self.tail_at = max(0, length - self._EDGE)
        self.tail = os.pread(fd, length - self.tail_at, base + self.tail_at)

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: "bytearray | memoryview") -> int:  # type: ignore[override]
        n = max(0, min(len(b), self.length - self.pos))
        if self.pos + n <= len(self.head):
            data = self.head[self.pos : self.pos + n]
        elif self.pos >= self.tail_at:
            data = self.tail[self.pos - self.tail_at : self.pos - self.tail_at + n]
        else:
            data = os.pread(self.fd, n, self.base + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass
class OpenChunk:
    """A chunk's bytes, row-major in the chunk: at ``data_start`` in ``fd``, or decoded in ``mem``."""

    box: SrcChunk
    fd: int
    data_start: int = 0
    mem: memoryview | None = None
    decoded_by_torch: bool = False

    def close(self) -> None:
        os.close(self.fd)


def open_chunk(c: SrcChunk, dtype: str, itemsize: int) -> OpenChunk:
    """Find a chunk's bytes with :mod:`zipfile` (or decode it with DCP's reader when it must be decoded).

    Raises:
        ConsolidationError: not a torch.save archive of one tensor, or not the dtype and
            shape ``.metadata`` declares.
    """
    fd = os.open(c.file, os.O_RDONLY)
    if c.data_start is not None:  # located (and checked) for an earlier tensor cut from this chunk
        return OpenChunk(c, fd, data_start=c.data_start)
    try:
        opened = _locate(c, dtype, itemsize, fd)
    except BaseException:
        os.close(fd)
        raise
    if opened.mem is None:
        c.data_start = opened.data_start
    return opened


def _locate(c: SrcChunk, dtype: str, itemsize: int, fd: int) -> OpenChunk:
    where = f"{c.file}@{c.offset}"
    if c.transforms:
        return OpenChunk(c, fd, mem=memoryview(_torch_load_chunk(_as_chunk(c))), decoded_by_torch=True)
    try:
        with zipfile.ZipFile(_Window(fd, c.offset, c.length)) as z:
            names = {n.split("/", 1)[-1]: n for n in z.namelist()}
            if "data.pkl" not in names:
                raise ConsolidationError(f"{where}: no data.pkl in the chunk's archive")
            if "byteorder" in names and z.read(names["byteorder"]) != b"little":
                raise ConsolidationError(f"{where}: big-endian chunk")
            ref = restricted_loads(z.read(names["data.pkl"]), f"{where}/data.pkl")
            if not isinstance(ref, TensorRef):
                raise ConsolidationError(f"{where}: the archive does not hold one tensor")
            info = z.getinfo(names.get(f"data/{ref.storage.key}", "?"))
    except (zipfile.BadZipFile, KeyError, EOFError) as exc:
        raise ConsolidationError(f"{where}: cannot read the chunk's archive with zipfile ({exc})") from None
    if ref.storage.dtype != dtype or ref.shape != c.sizes:
        raise ConsolidationError(f"{where}: holds {ref.storage.dtype}{list(ref.shape)}, .metadata says {dtype}{list(c.sizes)}")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ConsolidationError(f"{where}: tensor data is compressed inside the archive")
    local = os.pread(fd, 30, c.offset + info.header_offset)  # zipfile does not say where an entry's data starts
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise ConsolidationError(f"{where}: bad local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len + ref.storage_offset * itemsize
    numel = 1
    for s in c.sizes:
        numel *= s
    row_major = tuple(_strides(ref.shape))
    if numel > 1 and tuple(st for st, sz in zip(ref.stride, ref.shape) if sz > 1) != tuple(
            st for st, sz in zip(row_major, ref.shape) if sz > 1):
        return OpenChunk(c, fd, mem=memoryview(_torch_load_chunk(_as_chunk(c))), decoded_by_torch=True)
    if (ref.storage_offset + numel) * itemsize > info.file_size or start + numel * itemsize > c.length:
        raise ConsolidationError(f"{where}: tensor bytes run past the archive entry")
    return OpenChunk(c, fd, data_start=c.offset + start)


def _strides(shape: Box) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def _as_chunk(c: SrcChunk) -> Chunk:
    return Chunk(c.offsets, c.sizes, c.file, c.offset, c.length, c.transforms)
