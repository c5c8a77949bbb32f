"""Find the DCP directory (or directories, for averaging) inside what the user pointed at.

Layouts recognised, from a path given at any level:

* plain DCP: a directory with ``.metadata`` and ``__R_K.distcp`` files;
* this project: ``RUN_DIR/checkpoints/step-N/`` with ``RUN_DIR/hf_assets/`` as reference;
* Accelerate ``save_state``: ``pytorch_model_fsdp_0/`` (EMA: ``pytorch_ema_model_fsdp_0/``);
* HF Trainer: ``OUTPUT/checkpoint-N/pytorch_model_fsdp_0/`` with ``config.json`` beside it;
* torchtitan: ``step-N/`` with model keys at top level beside ``optimizer.*``;
* NeMo 2 / Lightning: ``weights/`` holding the DCP files, or ``meta.pt`` beside them;
* DeepSpeed ``save_checkpoint``: ``latest`` + ``global_stepN/*_model_states.pt`` (layout
  ``deepspeed``; the "DCP dir" is then the tag directory, read by :mod:`.deepspeed`).

Unfinished saves (``step-N.tmp*``) never match the step pattern and are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .deepspeed import find_deepspeed_dir
from .errors import ConsolidationError

STEP_RE = re.compile(r"(?:step|checkpoint|global_step|iter|epoch=\d+-step)[-_=]?(\d+)")
_MODEL_DIR_RE = re.compile(r"pytorch_model_fsdp_(\d+)")
_EMA_DIR_RE = re.compile(r"pytorch_ema_model_fsdp_(\d+)")


@dataclass
class Resolved:
    """What to consolidate."""

    layout: str
    dcp_dirs: list[Path]
    steps: list[int | None]
    reference: Path | None
    subtree_key: str | None = None
    notes: list[str] = field(default_factory=list)


def _is_dcp(d: Path) -> bool:
    return (d / ".metadata").is_file()


def _steps_in(d: Path) -> dict[int, Path]:
    out = {}
    if not d.is_dir():
        return out
    for child in d.iterdir():
        m = STEP_RE.fullmatch(child.name)
        if m and child.is_dir():
            out[int(m.group(1))] = child
    return out


def _subdirs(d: Path) -> list[str]:
    return sorted(c.name for c in d.iterdir() if c.is_dir()) if d.is_dir() else []


def find_dcp_dir(d: Path, subtree: str | None) -> tuple[Path, str, str | None]:
    """Return (DCP dir, layout name, key subtree) for one checkpoint directory ``d``."""
    if subtree and (d / subtree).is_dir() and _is_dcp(d / subtree):
        return d / subtree, "dcp-subdir", None
    if subtree == "ema":
        ema = sorted(c for c in d.iterdir() if c.is_dir() and _EMA_DIR_RE.fullmatch(c.name) and _is_dcp(c)) if d.is_dir() else []
        if ema:
            return ema[0], "accelerate-ema", None
    if _is_dcp(d):
        layout = "lightning" if (d / "meta.pt").is_file() else "dcp"
        return d, layout, subtree
    models = sorted((c for c in d.iterdir() if c.is_dir() and _MODEL_DIR_RE.fullmatch(c.name) and _is_dcp(c)),
                    key=lambda c: int(_MODEL_DIR_RE.fullmatch(c.name).group(1))) if d.is_dir() else []
    if models:
        layout = "hf-trainer" if STEP_RE.fullmatch(d.name) else "accelerate"
        return models[0], layout, subtree
    if _is_dcp(d / "weights"):
        return d / "weights", "nemo2", subtree
    ds = find_deepspeed_dir(d)
    if ds is not None:
        return ds, "deepspeed", subtree
    if d.is_dir() and any(d.glob("*.distcp")):
        raise ConsolidationError(
            f"{d / '.metadata'}: missing DCP metadata file beside {len(list(d.glob('*.distcp')))} .distcp shard(s); "
            "the save did not finish (DCP writes '.metadata' last). Use an earlier, complete checkpoint."
        )
    candidates = [c.name for c in d.iterdir() if c.is_dir() and _is_dcp(c) and "optim" not in c.name] if d.is_dir() else []
    if len(candidates) == 1:
        sub, kind, key = find_dcp_dir(d / candidates[0], subtree)
        return sub, ("dcp-subdir" if kind == "dcp" else kind), key
    if candidates:
        raise ConsolidationError(f"{d}: several DCP checkpoints inside: {sorted(candidates)}; pass --subtree NAME to pick one")
    raise ConsolidationError(
        f"{d}: no DCP checkpoint found (no '.metadata' here, nor in pytorch_model_fsdp_0/, weights/ or a step-N/ "
        f"subdirectory). Subdirectories present: {_subdirs(d) or 'none'}. Point SRC at a directory containing '.metadata'."
    )


def _pick_steps(steps_found: dict[int, Path], where: Path, step: int | None, average_last: int | None,
                steps: list[int] | None) -> list[int]:
    avail = sorted(steps_found)
    if not avail:
        raise ConsolidationError(f"{where}: no step-N / checkpoint-N directories (found: {_subdirs(where) or 'nothing'})")
    if steps:
        missing = [s for s in steps if s not in steps_found]
        if missing:
            raise ConsolidationError(f"--steps {missing}: not found in {where}; available steps are {avail}")
        return list(steps)
    if average_last:
        if average_last > len(avail):
            raise ConsolidationError(f"--average-last {average_last}: only {len(avail)} steps in {where} ({avail})")
        return avail[-average_last:]
    if step is not None:
        if step not in steps_found:
            raise ConsolidationError(f"--step {step}: not found in {where}; available steps are {avail}")
        return [step]
    return [avail[-1]]


def _find_reference(start: Path, stop_levels: int = 4) -> Path | None:
    d = start
    for _ in range(stop_levels):
        for cand in (d / "hf_assets", d):
            if (cand / "config.json").is_file():
                return cand
        if d.parent == d:
            break
        d = d.parent
    return None


def resolve(src: Path, *, step: int | None = None, average_last: int | None = None, steps: list[int] | None = None,
            subtree: str | None = None, reference: Path | None = None) -> Resolved:
    """Work out the DCP directories, steps and reference assets for ``src``.

    Raises:
        ConsolidationError: ``src`` is missing or holds no (unique) checkpoint.
    """
    src = Path(src)
    if not src.exists():
        raise ConsolidationError(f"{src}: source path does not exist")
    if not src.is_dir():
        raise ConsolidationError(f"{src}: source must be a checkpoint directory, not a file")
    container = None
    if _steps_in(src / "checkpoints") and not _is_dcp(src):
        container, layout = src / "checkpoints", "project"
    elif _steps_in(src) and not _is_dcp(src):
        container, layout = src, None
    multi = bool(steps or average_last)
    if container is None:
        if multi:
            raise ConsolidationError(f"{src}: --average-last/--steps need a directory of step-N checkpoints, but this is a single checkpoint")
        dcp_dir, kind, key = find_dcp_dir(src, subtree)
        if STEP_RE.fullmatch(src.name) and kind == "dcp" and (src.parent.name == "checkpoints"):
            kind = "project"
        elif STEP_RE.fullmatch(src.name) and kind == "dcp":
            kind = "torchtitan-or-dcp"
        ref = reference or _find_reference(dcp_dir)
        m = STEP_RE.fullmatch(src.name)
        return Resolved(kind, [dcp_dir], [int(m.group(1)) if m else None], ref, key)
    found = _steps_in(container)
    chosen = _pick_steps(found, container, step, average_last, steps)
    dirs, kinds, key = [], set(), None
    for s in chosen:
        d, kind, key = find_dcp_dir(found[s], subtree)
        dirs.append(d)
        kinds.add(kind)
    if "deepspeed" in kinds:
        layout = "deepspeed" if len(kinds) == 1 else "mixed"
    if layout is None:
        layout = kinds.pop() if len(kinds) == 1 else "mixed"
        if layout == "dcp" and container.name == "checkpoints":
            layout = "project"
    ref = reference or _find_reference(dirs[-1])
    return Resolved(layout, dirs, chosen, ref, key)
