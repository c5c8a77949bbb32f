"""DeepSpeed ZeRO checkpoints (``engine.save_checkpoint``) as a consolidation source.

A DeepSpeed checkpoint directory holds ``latest`` (the tag) and ``<tag>/`` with
``*_model_states.pt`` (module, ``param_shapes``, ``shared_params``) and one
``*zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank holding that
rank's flat fp32 master-weight partitions. This module rebuilds every parameter's
fp32 master weight from those partitions, as DeepSpeed's ``zero_to_fp32`` does, but
without its ``torch.load(weights_only=False)``: files are read with
``weights_only=True``, and the three DeepSpeed types pickled in them are mapped to
inert stand-ins (:func:`fsdp_workflow.core.safe_pickle.load_torch_file`, shared with the
trainer's resume check; DeepSpeed need not be installed, and none of its code runs).

Layouts (DeepSpeed 0.19):

* ZeRO-1/2: per param group ``g``, rank ``r`` holds ``single_partition_of_fp32_groups[g]``;
  the group's parameters (``param_shapes[g]``, in order) lie back to back in the
  concatenation over ranks, followed by alignment padding. ``param_slice_mappings``
  (each rank's fragment start and length) is checked against that walk.
* ZeRO-3: each parameter of ``numel`` n is split into ``ceil(n / W)`` elements per rank
  (the last rank padded); rank ``r``'s ``fp32_flat_groups`` concatenated hold its
  piece of every parameter, in ``param_shapes`` order.

Each rebuilt tensor is ``torch.save``-d into a staging file beside the output, in the
same per-item archive form as a DCP shard, so the package's streaming writer, casts,
tied-weight check and verification apply unchanged. Memory: the optimizer files are
memory-mapped, and one parameter at a time is materialised; the staging file takes
the fp32 model's size on disk until the consolidation ends.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, TypedDict

from fsdp_workflow.core.rundir import DEEPSPEED_LATEST
from fsdp_workflow.core.safe_pickle import CorruptPickleError, FragmentAddress, UnsafePickleError, load_torch_file

from .consolidation_errors import ConsolidationError, UnsafeCheckpointError
from .reader import Chunk, SourceTensor

if TYPE_CHECKING:
    from torch import Size, Tensor


class ModuleMatch(TypedDict):
    """ZeRO-1/2: how many rebuilt fp32 masters round exactly to the saved 16-bit module."""

    matching: int
    differing: list[str]


# What verification.json records about one DeepSpeed source (a key starts with a digit,
# hence the functional form).
DeepSpeedReport = TypedDict("DeepSpeedReport", {
    "zero_stage": int,
    "world_size": int,
    "tag": str,
    "source": str,
    "shared_params": Dict[str, str],
    "16bit_module_matches_fp32": ModuleMatch,
}, total=False)


_TAG_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_OPTIM_RE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL_RE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
SOURCE_FP32 = "fp32 master weights from the ZeRO optimizer partitions (*_optim_states.pt)"
# torch.load's result for a DeepSpeed file: nested dicts and lists of tensors, numbers and
# the stand-ins of fsdp_workflow.core.safe_pickle; its keys are read (and checked) below.
DeepSpeedState = Dict[str, Any]
ParamShapes = List[Dict[str, "Size"]]  # per param group: name -> shape, in partition order


def is_deepspeed_dir(d: Path) -> bool:
    """True when ``d`` is a DeepSpeed tag directory (holds ``*_model_states.pt``)."""
    return d.is_dir() and any(_MODEL_RE.fullmatch(p.name) for p in d.iterdir())


def find_deepspeed_dir(d: Path) -> Path | None:
    """The tag directory of the DeepSpeed checkpoint at ``d`` (itself, or the one ``latest`` names).

    Args:
        d: A directory the user pointed at (or one below it).

    Returns:
        The tag directory, or None when ``d`` holds no DeepSpeed checkpoint.

    Raises:
        ConsolidationError: ``latest`` names a missing or unsafe directory.
    """
    if is_deepspeed_dir(d):
        return d
    latest = d / DEEPSPEED_LATEST
    if latest.is_file():
        tag = latest.read_text(errors="replace").strip()
        if not _TAG_RE.fullmatch(tag) or tag in (".", ".."):
            raise ConsolidationError(f"{latest}: holds {tag[:80]!r}, not a DeepSpeed tag (letters, digits, '_', '.', '-')")
        if not is_deepspeed_dir(d / tag):
            raise ConsolidationError(
                f"{d / tag}: 'latest' names this DeepSpeed tag, but it holds no *_model_states.pt "
                f"(present: {sorted(c.name for c in d.iterdir())}); the save did not finish or was moved"
            )
        return d / tag
    tagged = [c for c in d.iterdir() if is_deepspeed_dir(c)] if d.is_dir() else []
    return tagged[0] if len(tagged) == 1 else None


def load_safely(path: Path) -> DeepSpeedState:
    """Load a DeepSpeed ``*.pt`` file through :func:`fsdp_workflow.core.safe_pickle.load_torch_file`.

    That is ``torch.load(weights_only=True)`` with inert stand-ins for DeepSpeed's records,
    so nothing pickled in the file runs and DeepSpeed need not be installed.

    Args:
        path: A ``*_model_states.pt`` or ``*_optim_states.pt`` file.

    Returns:
        The file's top-level dict.

    Raises:
        UnsafeCheckpointError: The file holds objects other than tensors and DeepSpeed's records (refused).
        ConsolidationError: The file is truncated or corrupt, or not a dict.
    """
    try:
        state = load_torch_file(path)
    except UnsafePickleError as exc:
        raise UnsafeCheckpointError(str(exc)) from None
    except CorruptPickleError as exc:
        raise ConsolidationError(str(exc)) from None
    if not isinstance(state, dict):
        raise ConsolidationError(f"{path}: holds a {type(state).__name__}, not the dict DeepSpeed's save_checkpoint writes; "
                                 "point SRC at a DeepSpeed checkpoint directory")
    return state


class _Flat:
    """One rank's flat fp32 partitions, read as if concatenated (no copy)."""

    def __init__(self, parts: list[Tensor]) -> None:
        self.parts = [p.detach().reshape(-1) for p in parts]
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, off: int, n: int) -> list[Tensor]:
        out: list[Tensor] = []
        end = off + n
        for p, s, e in zip(self.parts, self.starts, self.starts[1:]):
            if e > off and s < end:
                out.append(p[max(off, s) - s : min(end, e) - s])
        return out


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint, exposed like :class:`~.reader.DcpCheckpoint`.

    Args:
        path: the tag directory (``.../global_stepN``); see :func:`find_deepspeed_dir`.
        staging_parent: where to put the staging file (beside the output).

    Raises:
        ConsolidationError: missing or unreadable rank files, an unsupported layout, or
            partitions that do not add up to ``param_shapes``.
    """

    def __init__(self, path: Path, staging_parent: Path) -> None:
        self.path = Path(path)
        model_files = sorted(p for p in self.path.iterdir() if _MODEL_RE.fullmatch(p.name))
        model = load_safely(model_files[0])
        self.world_size = int(model.get("dp_world_size") or 1)
        if int(model.get("mp_world_size") or 1) != 1:
            raise ConsolidationError(f"{self.path}: tensor/model parallel DeepSpeed checkpoints (mp_world_size "
                                     f"{model.get('mp_world_size')}) are not supported; only ZeRO data parallel")
        if model.get("frozen_param_shapes"):
            raise ConsolidationError(
                f"{self.path}: holds frozen (requires_grad=False) parameters {list(model['frozen_param_shapes'])[:5]}, "
                "which this reader does not rebuild yet; unfreeze them for training or convert with DeepSpeed on a trusted copy")
        optim: dict[int, Path] = {}
        for p in self.path.iterdir():
            m = _OPTIM_RE.fullmatch(p.name)
            if m:
                optim[int(m.group(1))] = p
        missing = [r for r in range(self.world_size) if r not in optim]
        if missing:
            raise ConsolidationError(
                f"{self.path}: optimizer partitions of rank(s) {missing} are missing (dp_world_size is {self.world_size}, "
                f"found ranks {sorted(optim)}); every rank's *zero_pp_rank_R_mp_rank_00_optim_states.pt is needed")
        states = [load_safely(optim[r])["optimizer_state_dict"] for r in range(self.world_size)]
        self.stage = int(states[0]["zero_stage"])
        shapes = [dict(g) for g in model["param_shapes"]]
        if self.stage == 3:
            params = self._zero3(states, shapes)
        elif self.stage in (1, 2):
            params = self._zero12(states, shapes)
        else:
            raise ConsolidationError(f"{self.path}: ZeRO stage {self.stage} has no optimizer partitions to rebuild from")
        module = model.get("module") or {}
        for name in model.get("buffer_names") or []:
            if name in module and module[name].numel():
                params[name] = module[name]
        self.shared: dict[str, str] = dict(model.get("shared_params") or {})
        self.bf16_check = self._compare_module(params, module) if self.stage != 3 else None
        self._staging = Path(tempfile.mkdtemp(prefix=".deepspeed-staging-", dir=staging_parent))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._staging), True)
        self.tensors = self._stage(params)

    # ------------------------------------------------------------------ rebuild
    def _zero12(self, states: list[DeepSpeedState], shapes: ParamShapes) -> dict[str, Tensor]:
        import torch

        params: dict[str, Tensor] = {}
        for g, group in enumerate(shapes):
            flats = [_Flat([s["single_partition_of_fp32_groups"][g]]) for s in states]
            bounds = [0]
            for f in flats:
                bounds.append(bounds[-1] + f.numel)
            where: dict[str, int] = {}
            off = 0
            for name, shape in group.items():
                n = math.prod(shape)
                pieces: list[Tensor] = []
                for r, f in enumerate(flats):
                    lo, hi = max(off, bounds[r]), min(off + n, bounds[r + 1])
                    if lo < hi:
                        pieces += f.read(lo - bounds[r], hi - lo)
                if sum(p.numel() for p in pieces) != n:
                    raise ConsolidationError(f"{self.path}: param group {g} ends at element {bounds[-1]}, but "
                                             f"'{name}' needs [{off}, {off + n}); the partitions do not match param_shapes")
                params[name] = torch.cat(pieces).view(shape)
                where[name] = off
                off += n
            align = 2 * self.world_size  # DeepSpeed pads each group to a multiple of this
            if math.ceil(off / align) * align != math.ceil(bounds[-1] / align) * align:
                raise ConsolidationError(f"{self.path}: param group {g} holds {bounds[-1]} elements across "
                                         f"{self.world_size} rank(s), param_shapes need {off}")
            self._check_fragments(states, g, bounds, where)
        return params

    def _check_fragments(self, states: list[DeepSpeedState], g: int, bounds: list[int], where: dict[str, int]) -> None:
        """Each rank's recorded fragment (start, numel) must sit where the walk put it (no unmodelled padding)."""
        for r, s in enumerate(states):
            mappings = s.get("param_slice_mappings")
            if not mappings:
                return
            for name, frag in mappings[g].items():
                if name not in where or not isinstance(frag, FragmentAddress):
                    continue
                expect = max(where[name], bounds[r]) - bounds[r]
                if int(frag.start) != expect:
                    raise ConsolidationError(
                        f"{self.path}: rank {r} stores '{name}' at partition offset {frag.start}, the layout walk "
                        f"expects {expect}; this checkpoint pads parameters in a way this reader does not model")

    def _zero3(self, states: list[DeepSpeedState], shapes: ParamShapes) -> dict[str, Tensor]:
        import torch

        flats = [_Flat(list(s["fp32_flat_groups"])) for s in states]
        w = self.world_size
        params: dict[str, Tensor] = {}
        off = 0
        for group in shapes:
            for name, shape in group.items():
                n = math.prod(shape)
                part = math.ceil(n / w)
                if off + part > flats[0].numel:
                    raise ConsolidationError(f"{self.path}: the ranks' fp32 partitions hold {flats[0].numel} elements each, "
                                             f"'{name}' needs [{off}, {off + part}); they do not match param_shapes")
                pieces = [p for f in flats for p in f.read(off, part)]
                params[name] = torch.cat(pieces)[:n].view(shape)
                off += part
        short = [r for r, f in enumerate(flats) if f.numel != off]
        if short:
            raise ConsolidationError(f"{self.path}: rank(s) {short} hold {[flats[r].numel for r in short]} fp32 elements, "
                                     f"param_shapes need {off} per rank; the partitions belong to another model")
        return params

    @staticmethod
    def _compare_module(params: dict[str, Tensor], module: dict[str, Tensor]) -> ModuleMatch:
        """ZeRO-1/2 also save the 16-bit module: the fp32 masters must round to it exactly."""
        same, differ = 0, []
        for name, t in params.items():
            m = module.get(name)
            if m is None or m.numel() != t.numel():
                continue
            if bool((t.to(m.dtype) == m.reshape(t.shape)).all()):
                same += 1
            else:
                differ.append(name)
        return {"matching": same, "differing": differ[:5]}

    # ------------------------------------------------------------------ staging
    def _stage(self, params: dict[str, Tensor]) -> dict[str, SourceTensor]:
        """Write each tensor as one torch.save archive (a DCP-shard-like file) and describe its chunk."""
        import torch

        file = self._staging / "rebuilt.distcp"
        out: dict[str, SourceTensor] = {}
        with open(file, "wb") as f:
            for name, t in params.items():
                start = f.tell()
                torch.save(t.detach().contiguous().clone(), f)
                length = f.tell() - start
                shape = tuple(t.shape)
                dtype = str(t.dtype).removeprefix("torch.")
                out[name] = SourceTensor(name, dtype, shape, [Chunk((0,) * len(shape), shape, file, start, length)])
        for alias, target in self.shared.items():
            if target in out and alias not in out:
                src = out[target]
                out[alias] = SourceTensor(alias, src.dtype, src.shape, list(src.chunks))
        return out

    def check_files(self, fqns: list[str]) -> None:
        """Nothing left to check: every rank file was read when the checkpoint was opened."""

    def describe(self) -> DeepSpeedReport:
        """What verification.json records about this source."""
        info: DeepSpeedReport = {"zero_stage": self.stage, "world_size": self.world_size, "tag": self.path.name,
                                "source": SOURCE_FP32, "shared_params": self.shared}
        if self.bf16_check is not None:
            info["16bit_module_matches_fp32"] = self.bf16_check
        return info

    def close(self) -> None:
        """Remove the staging file now (also done when the object is collected or at exit)."""
        self._finalizer()
