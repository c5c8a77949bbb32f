"""Read DCP ``.metadata``, ``meta.pt`` and per-chunk ``data.pkl`` without running their code.

torch's own ``FileSystemReader.read_metadata`` calls plain ``pickle.load``, so a crafted
``.metadata`` runs arbitrary code inside any tool that merges it. Here every global a
pickle names goes through the project's one allow-list
(:class:`fsdp_workflow.core.safe_pickle.AllowListUnpickler`, shared with the trainer's
resume) and is mapped to a small stand-in class defined in this module; nothing from the
checkpoint is imported or called, and torch is never imported, which also keeps the copy
path fast.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO, Iterable, SupportsInt

from fsdp_workflow.core.safe_pickle import (
    DCP_METADATA_MODULES,
    TORCH_STORAGE_DTYPES,
    AllowListUnpickler,
    is_tensor_archive_global,
    refusal,
)

from .consolidation_errors import ConsolidationError, UnsafeCheckpointError

# torch dtype name -> (safetensors dtype, bytes per element, is floating point)
DTYPES: dict[str, tuple[str, int, bool]] = {
    "float64": ("F64", 8, True),
    "float32": ("F32", 4, True),
    "float16": ("F16", 2, True),
    "bfloat16": ("BF16", 2, True),
    "float8_e4m3fn": ("F8_E4M3", 1, True),
    "float8_e5m2": ("F8_E5M2", 1, True),
    "int64": ("I64", 8, False),
    "int32": ("I32", 4, False),
    "int16": ("I16", 2, False),
    "int8": ("I8", 1, False),
    "uint8": ("U8", 1, False),
    "uint16": ("U16", 2, False),
    "uint32": ("U32", 4, False),
    "uint64": ("U64", 8, False),
    "bool": ("BOOL", 1, False),
}
_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32", "short": "int16"}


class _Record:
    """Base for stand-ins: accepts the state dataclass pickles carry (dict or tuple)."""

    _tuple_fields: tuple[str, ...] = ()

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))):
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and self._tuple_fields:
            self.__dict__.update(zip(self._tuple_fields, state))
        else:
            raise UnsafeCheckpointError(f"unexpected pickled state for {type(self).__name__}: {type(state).__name__}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class Metadata(_Record):
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    storage_data: dict[MetadataIndex, StorageInfo] | None = None
    planner_data: object = None
    storage_meta: object = None
    version: str | None = None


class TensorStorageMetadata(_Record):
    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkStorageMetadata]


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class TensorProperties(_Record):
    _tuple_fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    dtype: DType


class MetadataIndex(_Record):
    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = None


class StorageInfo(_Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None = None


class StorageMeta(_Record):
    pass


@dataclass(frozen=True)
class DType:
    """A torch dtype by name ("bfloat16")."""

    name: str

    @property
    def st_code(self) -> str:
        return dtype_info(self.name)[0]


def dtype_info(name: str) -> tuple[str, int, bool]:
    """Return (safetensors code, itemsize, is_float) for a torch dtype name."""
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ConsolidationError(f"tensor dtype torch.{name} is not supported by safetensors output; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def _size(items: Iterable[SupportsInt] = ()) -> tuple[int, ...]:
    return tuple(int(i) for i in items)


def _enum_value(value: object) -> object:
    return value


def _layout(name: str) -> str:
    return str(name)


@dataclass(frozen=True)
class StorageClass:
    """A legacy typed-storage class (``torch.FloatStorage``) named in a ``data.pkl``, by dtype."""

    dtype: str


@dataclass
class StorageRef:
    """A persistent storage reference from a torch.save ``data.pkl``."""

    dtype: str
    key: str
    numel: int


@dataclass
class TensorRef:
    """What ``_rebuild_tensor_v2`` would have built, without building it."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: StorageRef, storage_offset: int, size: Iterable[SupportsInt],
                    stride: Iterable[SupportsInt], *_: object) -> TensorRef:
    return TensorRef(storage, int(storage_offset), _size(size), _size(stride))


class _Opaque:
    """Stand-in for an unknown class in lenient mode: records its name, runs nothing."""

    def __init__(self, qualname: str, *args: object, **kwargs: object) -> None:
        self.qualname = qualname

    def __call__(self, *args: object, **kwargs: object) -> _Opaque:
        return _Opaque(self.qualname)

    def __setstate__(self, state: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"<opaque {self.qualname}>"


# What each global the shared allow-list admits stands for here. The allow-list itself
# lives in fsdp_workflow.core.safe_pickle; a name it admits that is missing below is
# refused (tests/consolidate/test_safety.py checks that none is).
_DCP_STAND_INS: dict[str, object] = {
    cls.__name__: cls for cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                                  TensorProperties, MetadataIndex, StorageMeta)
}
_DCP_STAND_INS["_MEM_FORMAT_ENCODING"] = _enum_value
_STAND_INS: dict[tuple[str, str], object] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
}


class RestrictedUnpickler(AllowListUnpickler):
    """The shared allow-list, resolved to torch-free stand-ins; anything else is refused.

    :meth:`allows` widens the DCP list to the names a tensor's ``data.pkl`` uses
    (:func:`~fsdp_workflow.core.safe_pickle.is_tensor_archive_global`), because the same
    reader parses every chunk's archive.

    Args:
        file: The pickle stream.
        source: A name for error messages (usually the file path).
    """

    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file, source)
        self.placeholders: list[str] = []  # unknown globals replaced (lenient mode only)

    def allows(self, module: str, name: str) -> bool:
        return is_tensor_archive_global(module, name)

    def resolve(self, module: str, name: str) -> object:
        """The stand-in for an allowed global; nothing is imported."""
        if module in DCP_METADATA_MODULES and name in _DCP_STAND_INS:
            return _DCP_STAND_INS[name]
        if (module, name) in _STAND_INS:
            return _STAND_INS[(module, name)]
        if module == "torch" and name in TORCH_STORAGE_DTYPES:
            return StorageClass(TORCH_STORAGE_DTYPES[name])
        if module == "torch":  # the allow-list admits torch.<name> otherwise only for dtypes
            return DType(_DTYPE_ALIASES.get(name, name))
        return self.refuse(module, name)

    def refuse(self, module: str, name: str) -> object:
        """Raise :class:`UnsafeCheckpointError` with the shared refusal message."""
        raise UnsafeCheckpointError(refusal(self.source, module, name))

    def persistent_load(self, pid: object) -> object:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, kind, key, _location, numel = pid
            if isinstance(kind, StorageClass):
                return StorageRef(kind.dtype, str(key), int(numel))
            if isinstance(kind, DType):
                return StorageRef(kind.name, str(key), int(numel))
        return self.unexpected_persistent_id(pid)

    def unexpected_persistent_id(self, pid: object) -> object:
        """A persistent id that is not a tensor storage: refused."""
        raise UnsafeCheckpointError(f"{self.source}: unexpected persistent id {pid!r} in pickle")


class LenientUnpickler(RestrictedUnpickler):
    """For ``meta.pt``: unknown globals become inert :class:`_Opaque` stand-ins instead of a refusal.

    Lightning's hyper-parameters may hold any class; recording its name keeps the step and
    plain values readable while its code still never runs.
    """

    def refuse(self, module: str, name: str) -> object:
        self.placeholders.append(f"{module}.{name}")
        return _Opaque(f"{module}.{name}")

    def unexpected_persistent_id(self, pid: object) -> object:
        return _Opaque("persistent")


def restricted_loads(data: bytes, source: str, lenient: bool = False) -> object:
    """Unpickle ``data`` through the shared allow-list, into stand-ins.

    Args:
        data: The pickle bytes.
        source: A name for error messages (usually the file path).
        lenient: Replace globals outside the allow-list by inert placeholders instead of
            refusing them (for ``meta.pt``; see :class:`LenientUnpickler`).

    Returns:
        The unpickled object, built only from stand-ins and plain values.

    Raises:
        UnsafeCheckpointError: A global outside the allow-list (strict mode), or objects
            that cannot be rebuilt without the placeholders' real classes (lenient mode).
        ConsolidationError: The bytes are not a valid pickle.
    """
    unpickler = (LenientUnpickler if lenient else RestrictedUnpickler)(io.BytesIO(data), source)
    try:
        return unpickler.load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        if unpickler.placeholders:  # a class it references could not be stood in for (e.g. a dataclass's __new__)
            names = sorted(set(unpickler.placeholders))[:5]
            raise UnsafeCheckpointError(
                f"{source}: cannot rebuild the pickled objects: they reference classes outside the allow-list "
                f"({', '.join(names)}), which are never imported ({type(exc).__name__}: {exc})"
            ) from None
        raise ConsolidationError(f"{source}: cannot parse pickle ({type(exc).__name__}: {exc}); the file is corrupt or truncated") from None


def load_dcp_metadata(path: Path) -> Metadata:
    """Read a DCP ``.metadata`` file safely.

    Args:
        path: The ``.metadata`` file.

    Returns:
        The metadata, as stand-in objects.

    Raises:
        ConsolidationError: the file is missing, corrupt, or not DCP metadata.
        UnsafeCheckpointError: the pickle names a global outside the allow-list.
    """
    if not path.is_file():
        raise ConsolidationError(
            f"{path}: missing DCP metadata file. A complete torch.distributed.checkpoint save ends by "
            "writing '.metadata'; without it the save did not finish. Point at a finished checkpoint."
        )
    meta = restricted_loads(path.read_bytes(), str(path))
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise ConsolidationError(f"{path}: not a torch.distributed.checkpoint Metadata object (found {type(meta).__name__})")
    return meta


def load_meta_pt(path: Path) -> dict[str, object]:
    """Read Lightning's ``meta.pt`` (a torch.save zip) leniently, returning plain values.

    Args:
        path: The ``meta.pt`` file.

    Returns:
        Its top-level dict (or ``{"value": obj}`` for anything else).

    Raises:
        ConsolidationError: Not a readable zip archive with a ``data.pkl``.
        UnsafeCheckpointError: Objects that cannot be rebuilt from stand-ins.
    """
    obj = restricted_loads(_read_archive_member(path, "data.pkl"), str(path), lenient=True)
    return {str(k): v for k, v in obj.items()} if isinstance(obj, dict) else {"value": obj}


def _read_archive_member(path: Path, suffix: str) -> bytes:
    """Read one member (by name after the archive's top folder, e.g. ``data.pkl``) of a torch.save zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.split("/", 1)[-1] == suffix:
                    return archive.read(name)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, EOFError) as exc:
        raise ConsolidationError(f"{path}: cannot be read as a torch.save zip archive ({exc}); the file is truncated or corrupt") from None
    raise ConsolidationError(f"{path}: no '{suffix}' inside; not a torch.save file")
