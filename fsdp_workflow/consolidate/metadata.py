"""Read DCP ``.metadata``, ``meta.pt`` and per-chunk ``data.pkl`` without running their code.

torch's own ``FileSystemReader.read_metadata`` calls plain ``pickle.load``, so a crafted
``.metadata`` runs arbitrary code inside any tool that merges it. Here every global a
pickle names is looked up in an allow-list and mapped to a small stand-in class defined in
this module; nothing from the checkpoint is imported or called, and torch is never
imported, which also keeps the copy path fast.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from .errors import ConsolidationError, UnsafeCheckpointError

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
# Legacy typed-storage class names that torch.save writes into data.pkl.
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2",
    "UInt16Storage": "uint16", "UInt32Storage": "uint32", "UInt64Storage": "uint64",
}


class _Record:
    """Base for stand-ins: accepts the state dataclass pickles carry (dict or tuple)."""

    _tuple_fields: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
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
    state_dict_metadata: dict
    storage_data: dict | None = None
    planner_data: Any = None
    storage_meta: Any = None
    version: str | None = None


class TensorStorageMetadata(_Record):
    properties: "TensorProperties"
    size: tuple
    chunks: list


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets: tuple
    sizes: tuple


class TensorProperties(_Record):
    _tuple_fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    dtype: "DType"


class MetadataIndex(_Record):
    fqn: str
    offset: tuple | None = None
    index: int | None = None


class StorageInfo(_Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: list | None = None


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


def _size(items: Any = ()) -> tuple:
    return tuple(int(i) for i in items)


def _enum_value(value: Any) -> Any:
    return value


def _layout(name: str) -> str:
    return str(name)


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
    shape: tuple
    stride: tuple


def _rebuild_tensor(storage: StorageRef, storage_offset: int, size: Any, stride: Any, *_: Any) -> TensorRef:
    return TensorRef(storage, int(storage_offset), _size(size), _size(stride))


class _Opaque:
    """Placeholder for an unknown class in lenient mode: records its name, runs nothing."""

    def __init__(self, qualname: str, *args: Any, **kwargs: Any) -> None:
        self.qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> "_Opaque":
        return _Opaque(self.qualname)

    def __setstate__(self, state: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<opaque {self.qualname}>"


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata")
_ALLOWED: dict[tuple[str, str], Any] = {
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
for _mod in _DCP_MODULES:
    for _cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                 TensorProperties, MetadataIndex, StorageMeta):
        _ALLOWED[(_mod, _cls.__name__)] = _cls
    _ALLOWED[(_mod, "_MEM_FORMAT_ENCODING")] = _enum_value


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that maps allow-listed globals to stand-ins and refuses the rest.

    Args:
        file: The pickle stream.
        source: A name for error messages (usually the file path).
        lenient: Replace unknown globals by inert placeholders instead of refusing
            (used for ``meta.pt``, whose hyper-parameters may hold any class; their
            code still never runs).
    """

    def __init__(self, file: io.BufferedIOBase, source: str, lenient: bool = False) -> None:
        super().__init__(file)
        self.source = source
        self.lenient = lenient
        self.placeholders: list[str] = []  # unknown globals replaced in lenient mode

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol-2 spelling
            module = "builtins"
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage-class", STORAGE_DTYPES[name])
        if module == "torch" and (name in DTYPES or name in _DTYPE_ALIASES):
            return DType(_DTYPE_ALIASES.get(name, name))
        if self.lenient:
            self.placeholders.append(f"{module}.{name}")
            return _Opaque(f"{module}.{name}")
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to unpickle global '{module}.{name}'. Only DCP metadata classes, "
            "torch dtypes/Size and plain containers are allowed, so this file was not written by "
            "torch.distributed.checkpoint or has been tampered with. Nothing from it was executed. "
            "If you wrote it yourself with a newer DCP that adds classes, please report it."
        )

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, kind, key, _location, numel = pid
            if isinstance(kind, tuple) and kind[0] == "storage-class":
                return StorageRef(kind[1], str(key), int(numel))
            if isinstance(kind, DType):
                return StorageRef(kind.name, str(key), int(numel))
        if self.lenient:
            return _Opaque("persistent")
        raise UnsafeCheckpointError(f"{self.source}: unexpected persistent id {pid!r} in pickle")


def restricted_loads(data: bytes, source: str, lenient: bool = False) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`."""
    unpickler = RestrictedUnpickler(io.BytesIO(data), source, lenient)
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


def load_meta_pt(path: Path) -> dict[str, Any]:
    """Read Lightning's ``meta.pt`` (a torch.save zip) leniently, returning plain values."""
    from .zipchunk import read_zip_member

    data = read_zip_member(path, "data.pkl")
    obj = restricted_loads(data, str(path), lenient=True)
    return obj if isinstance(obj, dict) else {"value": obj}
