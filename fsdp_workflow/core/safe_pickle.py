"""Allow-list unpickling of checkpoint metadata, shared by the trainer's resume and the consolidator.

torch's ``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on
``.metadata``, and DeepSpeed loads its ``*.pt`` files with
``weights_only=False``: a crafted checkpoint runs code in either. Both readers
of this project go through the one allow-list here instead:

* :data:`DCP_METADATA_GLOBALS` - the globals a DCP ``.metadata`` pickle may
  name: DCP's metadata classes, ``torch.Size``, torch dtypes, plain containers
  and paths. :class:`AllowListUnpickler` refuses anything else before it is
  imported. The trainer resolves the allowed names to the real torch classes
  (DCP needs them to load); the consolidator subclasses it and resolves them to
  torch-free stand-ins. A tensor's ``data.pkl`` inside a ``torch.save`` archive
  may also name :data:`TENSOR_ARCHIVE_GLOBALS` (the consolidator reads those
  archives itself; :meth:`AllowListUnpickler.allows` widens the list for it).
* :func:`load_torch_file` - ``torch.load(weights_only=True)`` with inert
  stand-ins for the few DeepSpeed records its checkpoints pickle.

No torch import at module level: the consolidator's DCP path never imports torch.
"""

from __future__ import annotations

import importlib
import io
import pickle
import zipfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO, FrozenSet, Mapping, Tuple

DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata")
DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
# torch dtypes as pickled (``torch.bfloat16``) plus their legacy aliases.
TORCH_DTYPE_NAMES: FrozenSet[str] = frozenset({
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "uint16", "uint32", "uint64", "float", "double", "half", "long", "int", "short",
})
DCP_METADATA_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset(
    {(m, c) for m in DCP_METADATA_MODULES for c in DCP_METADATA_CLASSES} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


# A tensor's ``data.pkl`` inside a ``torch.save`` archive (each DCP chunk, Lightning's
# ``meta.pt``) names the rebuild function and, in files from older torch, a typed storage
# class per dtype. Readers that parse those archives themselves (the consolidator) allow
# these on top of :data:`DCP_METADATA_GLOBALS`; the trainer never needs them.
TORCH_STORAGE_DTYPES: Mapping[str, str] = MappingProxyType({
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "Float8_e4m3fnStorage": "float8_e4m3fn", "Float8_e5m2Storage": "float8_e5m2",
    "UInt16Storage": "uint16", "UInt32Storage": "uint32", "UInt64Storage": "uint64",
})
TENSOR_ARCHIVE_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset(
    {("torch._utils", "_rebuild_tensor_v2")} | {("torch", name) for name in TORCH_STORAGE_DTYPES}
)


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list; nothing from it was executed."""


class CorruptPickleError(ValueError):
    """A file cannot be parsed at all: truncated or corrupt."""


def is_dcp_metadata_global(module: str, name: str) -> bool:
    """Whether a DCP ``.metadata`` pickle may name ``module.name``."""
    return (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and name in TORCH_DTYPE_NAMES)


def is_tensor_archive_global(module: str, name: str) -> bool:
    """Whether a tensor's ``data.pkl`` in a ``torch.save`` archive may name ``module.name``.

    That is everything a DCP ``.metadata`` may name plus :data:`TENSOR_ARCHIVE_GLOBALS`.
    """
    return is_dcp_metadata_global(module, name) or (module, name) in TENSOR_ARCHIVE_GLOBALS


def refusal(source: str, module: str, name: str) -> str:
    """The message for a refused global: what was refused, why, and what to do."""
    return (f"{source}: refusing to unpickle global '{module}.{name}'. Only DCP metadata classes, torch "
            "dtypes/Size and plain containers are allowed, so this file was not written by "
            "torch.distributed.checkpoint or has been tampered with. Nothing from it was executed. "
            "If you wrote it yourself with a newer DCP that adds classes, please report it.")


class AllowListUnpickler(pickle.Unpickler):
    """Unpickles only :data:`DCP_METADATA_GLOBALS`; :meth:`resolve` decides what each becomes.

    Args:
        file: the pickle stream.
        source: a name for error messages (usually the file path).
    """

    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol-2 spelling
            module = "builtins"
        if self.allows(module, name):
            return self.resolve(module, name)
        return self.refuse(module, name)

    def allows(self, module: str, name: str) -> bool:
        """The allow-list this unpickler applies: by default :func:`is_dcp_metadata_global`.

        A reader of whole ``torch.save`` archives widens it to :func:`is_tensor_archive_global`;
        nothing else should.
        """
        return is_dcp_metadata_global(module, name)

    def resolve(self, module: str, name: str) -> Any:
        """The object an allowed global stands for: by default the real one (imports torch)."""
        obj = getattr(importlib.import_module(module), name)
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            import torch

            if not isinstance(obj, torch.dtype):  # e.g. torch.float is a dtype, torch.int is too
                raise UnsafePickleError(refusal(self.source, module, name))
        return obj

    def refuse(self, module: str, name: str) -> Any:
        """Called for a global outside the allow-list; raises :class:`UnsafePickleError`."""
        raise UnsafePickleError(refusal(self.source, module, name))


def load_dcp_metadata(path: Path) -> Any:
    """Read a DCP ``.metadata`` file into torch's own ``Metadata``, through the allow-list.

    Raises:
        UnsafePickleError: the file names a global outside the allow-list.
        CorruptPickleError: the file is missing a part, truncated or not a pickle.
    """
    data = Path(path).read_bytes()
    try:
        return AllowListUnpickler(io.BytesIO(data), str(path)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt file
        raise CorruptPickleError(f"{path}: cannot parse DCP metadata ({type(exc).__name__}: {exc}); "
                                 "the file is corrupt or truncated") from None


# ---------------------------------------------------------------- DeepSpeed *.pt files
class _LossScaler:
    """Stands in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (state kept as attributes)."""


class _ZeroStage(int):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``ZeroStageEnum(n)``)."""


class FragmentAddress:
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""

    numel: int
    start: int


# Inert stand-ins named by DeepSpeed's qualified names, so its files load under
# weights_only=True without importing DeepSpeed.
DEEPSPEED_SAFE_GLOBALS = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_torch_file(path: Path) -> Any:
    """``torch.load(weights_only=True, mmap=True)`` with the DeepSpeed stand-ins; never runs pickled code.

    Raises:
        UnsafePickleError: the file holds objects other than tensors and DeepSpeed's plain records.
        CorruptPickleError: the file is truncated or corrupt.
    """
    import torch

    try:
        with torch.serialization.safe_globals(DEEPSPEED_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafePickleError(
            f"{path}: refused to unpickle it (weights_only=True): it holds objects other than tensors and "
            f"DeepSpeed's plain records ({first[:300]}). Use only checkpoints from a trusted writer; "
            "nothing in the file was executed."
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CorruptPickleError(
            f"{path}: cannot be read as a torch checkpoint ({str(exc).splitlines()[0][:200]}); the file is "
            "truncated or corrupt (an interrupted save or copy). Use an earlier, complete checkpoint."
        ) from None
