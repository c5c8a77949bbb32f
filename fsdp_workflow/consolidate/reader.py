"""Index a DCP checkpoint directory: which bytes of which file make up each tensor.

Nothing here loads tensor data. :class:`DcpCheckpoint` reads ``.metadata`` with the
restricted unpickler, deduplicates replicated chunks (2-D meshes), checks that chunks tile
each tensor and that shard files are long enough, and turns every chunk into "runs":
contiguous byte ranges that map one-to-one onto the row-major output tensor.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from fsdp_workflow.core.rundir import DCP_METADATA

from .consolidation_errors import ConsolidationError
from .metadata import BytesStorageMetadata, StorageInfo, TensorStorageMetadata, dtype_info, load_dcp_metadata
from .zipchunk import ChunkData, locate_chunk

Shape = tuple[int, ...]


def prod(xs: Shape) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


@dataclass
class Chunk:
    """One stored piece of a tensor: its place in the tensor and its byte range on disk."""

    offsets: Shape
    sizes: Shape
    file: Path
    offset: int
    length: int
    transforms: tuple[str, ...] = ()
    base: int = 0  # first element of these bytes in the stored chunk (a box of it: :meth:`SourceTensor.select`)
    stored: Shape | None = None  # the stored chunk's own sizes when this is a box of it
    parent: Chunk | None = None  # the stored chunk this is a box of (its location is found once for all its boxes)
    located: ChunkData | None = field(default=None, repr=False, compare=False)  # set on a parent once found

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass
class SourceTensor:
    """A tensor of the checkpoint: dtype name, global shape and its chunks."""

    fqn: str
    dtype: str
    shape: Shape
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype)[1]

    def select(self, index: Shape, rows: tuple[int, int]) -> SourceTensor:
        """The box ``self[index..., rows[0]:rows[1], ...]`` as a tensor of its own (an expert of a fused MoE tensor).

        Inside each chunk the box is one contiguous byte range (fixed indices, then a range
        of one dimension, then every later dimension whole), so each chunk meeting it
        becomes one chunk of the result at an element offset into the stored bytes, and the
        writer copies byte ranges as for any tensor.

        Args:
            index: Indices of the leading dimensions.
            rows: A range of the next dimension.

        Returns:
            A tensor of shape ``(rows[1] - rows[0],) + shape[len(index) + 1:]``.
        """
        k = len(index)
        lo, hi = rows
        assert k < len(self.shape) and 0 <= lo < hi <= self.shape[k], (self.fqn, index, rows)
        out = SourceTensor(self.fqn, self.dtype, (hi - lo,) + self.shape[k + 1:])
        for c in self.chunks:
            if any(not (o <= i < o + n) for i, o, n in zip(index, c.offsets, c.sizes)):
                continue
            a, b = max(lo, c.offsets[k]), min(hi, c.offsets[k] + c.sizes[k])
            if a >= b:
                continue
            stored = c.stored or c.sizes
            strides = row_major_strides(c.sizes)
            local = [i - o for i, o in zip(index, c.offsets)] + [a - c.offsets[k]]
            base = c.base + sum(i * st for i, st in zip(local, strides))
            out.chunks.append(Chunk((a - lo,) + c.offsets[k + 1:], (b - a,) + c.sizes[k + 1:], c.file, c.offset,
                                    c.length, c.transforms, base, stored, c.parent or c))
        assert sum(c.numel for c in out.chunks) == out.numel, (self.fqn, index, rows)
        return out


def row_major_strides(shape: Shape) -> Shape:
    strides: list[int] = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def chunk_runs(shape: Shape, chunk: Chunk) -> list[tuple[int, int, int]]:
    """Contiguous pieces of ``chunk`` as (src element offset, dst element offset, elements)."""
    n = len(shape)
    if n == 0:
        return [(0, 0, 1)]
    if chunk.numel == 0:
        return []
    strides = row_major_strides(shape)
    k = n - 1
    while k > 0 and chunk.offsets[k] == 0 and chunk.sizes[k] == shape[k]:
        k -= 1
    run = chunk.sizes[k] * strides[k]
    base = chunk.offsets[k] * strides[k]
    runs: list[tuple[int, int, int]] = []
    src = 0
    for idx in itertools.product(*(range(chunk.sizes[j]) for j in range(k))):
        dst = base + sum((chunk.offsets[j] + i) * strides[j] for j, i in enumerate(idx))
        runs.append((src, dst, run))
        src += run
    return runs


class CheckpointSource(Protocol):
    """What the consolidation steps need of one source checkpoint, whatever wrote it.

    :class:`DcpCheckpoint` indexes a DCP directory in place; ``DeepSpeedCheckpoint``
    rebuilds ZeRO partitions into a staging file, which :meth:`close` removes.
    """

    path: Path
    tensors: dict[str, SourceTensor]

    def check_files(self, fqns: list[str]) -> None:
        """Raise :class:`ConsolidationError` when bytes the tensors ``fqns`` need are missing."""

    def close(self) -> None:
        """Release what the source holds on disk or open; safe to call twice."""


class DcpCheckpoint:
    """A DCP directory (``.metadata`` plus ``__R_K.distcp`` files), indexed, not loaded.

    Args:
        path: The directory holding ``.metadata``.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.metadata = load_dcp_metadata(self.path / DCP_METADATA)
        storage: dict[tuple[str, Shape | None], StorageInfo] = {}
        for idx, info in (self.metadata.storage_data or {}).items():
            storage[(idx.fqn, tuple(idx.offset) if idx.offset is not None else None)] = info
        self.tensors: dict[str, SourceTensor] = {}
        self.bytes_keys: list[str] = []
        for fqn, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                self.bytes_keys.append(fqn)
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise ConsolidationError(f"{self.path / DCP_METADATA}: key '{fqn}' has unknown storage type {type(md).__name__}")
            self.tensors[fqn] = self._tensor(fqn, md, storage)

    def _tensor(self, fqn: str, md: TensorStorageMetadata, storage: dict[tuple[str, Shape | None], StorageInfo]) -> SourceTensor:
        t = SourceTensor(fqn, md.properties.dtype.name, tuple(md.size))
        seen: dict[Shape, Shape] = {}
        for c in md.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            if offsets in seen:  # replica of the same shard (HSDP / 2-D mesh)
                if seen[offsets] != sizes:
                    raise ConsolidationError(f"{self.path}: tensor '{fqn}' lists two chunks at offset {offsets} with different sizes")
                continue
            seen[offsets] = sizes
            info = storage.get((fqn, offsets))
            if info is None:
                raise ConsolidationError(f"{self.path / DCP_METADATA}: tensor '{fqn}' chunk at {offsets} has no storage entry; the metadata is incomplete")
            t.chunks.append(Chunk(offsets, sizes, self.path / info.relative_path, int(info.offset), int(info.length),
                                  tuple(info.transform_descriptors or ())))
        covered = sum(c.numel for c in t.chunks)
        if covered != t.numel:
            raise ConsolidationError(
                f"{self.path}: tensor '{fqn}' of shape {list(t.shape)} has chunks covering {covered} of {t.numel} elements; "
                "a rank's shard is missing from the metadata"
            )
        return t

    def close(self) -> None:
        """Nothing to release: the index holds no open files (each read opens its own)."""

    def check_files(self, fqns: list[str]) -> None:
        """Raise if a shard file is missing or shorter than the metadata says.

        Every storage item is checked, not only those of ``fqns``: a shard cut short in its
        optimizer part still means the save (or the copy) was interrupted.
        """
        need: dict[Path, int] = {}
        for fqn in fqns:
            for c in self.tensors[fqn].chunks:
                need[c.file] = max(need.get(c.file, 0), c.offset + c.length)
        for info in (self.metadata.storage_data or {}).values():
            f = self.path / info.relative_path
            need[f] = max(need.get(f, 0), int(info.offset) + int(info.length))
        for f, end in sorted(need.items()):
            if not f.is_file():
                raise ConsolidationError(f"{f}: shard file is missing (the metadata lists chunks in it); copy it back or use another checkpoint")
            size = f.stat().st_size
            if size < end:
                raise ConsolidationError(f"{f}: shard file is truncated ({size} bytes, the metadata needs {end}); the save or the copy was interrupted")


class ChunkHandle:
    """Readable bytes of one chunk, in row-major order of the chunk itself.

    Plain chunks are read straight from the shard file at the located offset. Chunks
    written with stream transforms (zstd) or stored non-contiguously go through DCP's
    own extension registry and ``torch.load(weights_only=True)``.
    """

    def __init__(self, chunk: Chunk, dtype: str) -> None:
        self.chunk = chunk
        self.fd = os.open(chunk.file, os.O_RDONLY)
        self.mem: bytes | None = None
        self.data: ChunkData | None = None
        self._data_offset = 0  # absolute offset of the chunk's bytes when read from the file
        item = dtype_info(dtype)[1]
        if chunk.transforms:
            self.mem = _torch_load_chunk(chunk)
        else:
            if chunk.parent is not None and chunk.parent.located is not None:  # an earlier expert of this chunk found it
                self.data = chunk.parent.located
            else:
                self.data = locate_chunk(self.fd, chunk.offset, chunk.length, str(chunk.file))
                if chunk.parent is not None:
                    chunk.parent.located = self.data
            self._data_offset = self.data.data_offset + chunk.base * item
            stored = chunk.stored or chunk.sizes
            if self.data.dtype != dtype or self.data.shape != stored:
                raise ConsolidationError(
                    f"{chunk.file}: chunk at offset {chunk.offset} holds {self.data.dtype}{list(self.data.shape)}, "
                    f"the metadata says {dtype}{list(stored)}; the shard does not belong to this checkpoint"
                )
            if not self.data.contiguous:
                self.mem = _torch_load_chunk(chunk)
        if self.mem is not None and chunk.stored is not None:  # a box of the decoded chunk: its bytes alone
            self.mem = self.mem[chunk.base * item : (chunk.base + chunk.numel) * item]

    @property
    def raw_offset(self) -> int | None:
        """Absolute file offset of the chunk bytes when they can be copied in-kernel."""
        return None if self.mem is not None else self._data_offset

    def read(self, off: int, n: int) -> bytes:
        if self.mem is not None:
            return self.mem[off : off + n]
        buf = os.pread(self.fd, n, self._data_offset + off)
        if len(buf) != n:
            raise ConsolidationError(f"{self.chunk.file}: truncated while reading chunk at offset {self.chunk.offset}")
        return buf

    def read_into(self, off: int, out: memoryview) -> None:
        """Fill ``out`` with the chunk's bytes from ``off``, without an intermediate buffer."""
        if self.mem is not None:
            out[:] = memoryview(self.mem)[off : off + len(out)]
            return
        pos, done = self._data_offset + off, 0
        while done < len(out):
            n = os.preadv(self.fd, [out[done:]], pos + done)
            if n == 0:
                raise ConsolidationError(f"{self.chunk.file}: truncated while reading chunk at offset {self.chunk.offset}")
            done += n

    def close(self) -> None:
        os.close(self.fd)


def _torch_load_chunk(chunk: Chunk) -> bytes:
    """Decode a chunk with DCP's own machinery (safe: weights_only=True)."""
    import io

    import torch
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    registry = ExtensionRegistry()
    for extension_class in EXTRA_EXTENSIONS:
        registry.register(extension_class)
    with open(chunk.file, "rb") as f:
        f.seek(chunk.offset)
        stream: IO[bytes] = io.BytesIO(f.read(chunk.length))
    try:
        for extension in registry.from_descriptor_list(list(chunk.transforms)):
            if not isinstance(extension, StreamTransformExtension):
                raise ValueError(f"{extension.registry_name()} is not a stream transform")
            stream = extension.transform_from(stream)
        data = io.BytesIO(stream.read())
        tensor = torch.load(data, map_location="cpu", weights_only=True)
    except ValueError as exc:
        raise ConsolidationError(f"{chunk.file}: chunk at offset {chunk.offset} uses transforms {list(chunk.transforms)}: {exc}") from None
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# Extension classes registered on top of DCP's defaults (tests add a custom one).
EXTRA_EXTENSIONS: list[type] = []
