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

Unfinished saves (``step-N.tmp*``) never match the step pattern and are ignored. A ``step-N``
without ``.metadata`` (a crashed save renamed anyway, a copy still in progress) is skipped,
with a note, when the newest step is chosen by default; named with ``--step`` or ``--steps``
it is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_workflow.core.checkpoint_health import dcp_problem
from fsdp_workflow.core.rundir import CHECKPOINTS_DIR, DCP_METADATA, HF_ASSETS_DIR, parse_step, step_name

from .deepspeed import find_deepspeed_dir
from .consolidation_errors import ConsolidationError, IncompleteCheckpointError

# Step directories of other tools (this project's ``step-N`` is fsdp_workflow.core.rundir's):
# HF Trainer ``checkpoint-N``, DeepSpeed ``global_stepN``, torchtitan/Megatron ``step_N`` /
# ``iter_N``, Lightning ``epoch=E-step=N``.
_FOREIGN_STEP_RE = re.compile(r"(?:step[_=]?|(?:checkpoint|global_step|iter|epoch=\d+-step)[-_=]?)(\d+)")
_MODEL_DIR_RE = re.compile(r"pytorch_model_fsdp_(\d+)")
_EMA_DIR_RE = re.compile(r"pytorch_ema_model_fsdp_(\d+)")


# (DCP directory, layout name, key subtree still to strip) for one checkpoint.
DcpHit = tuple[Path, str, str | None]


@dataclass
class Resolved:
    """What to consolidate."""

    layout: str
    dcp_dirs: list[Path]
    steps: list[int | None]
    reference: Path | None
    subtree_key: str | None = None
    notes: list[str] = field(default_factory=list)


def step_of(name: str) -> int | None:
    """The step a checkpoint directory's name says (``step-N``, ``checkpoint-N``, ``global_stepN``...), else None."""
    step = parse_step(name)
    if step is not None:
        return step
    m = _FOREIGN_STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def _is_dcp(d: Path) -> bool:
    return (d / DCP_METADATA).is_file()


def _steps_in(d: Path) -> dict[int, Path]:
    out: dict[int, Path] = {}
    if not d.is_dir():
        return out
    for child in d.iterdir():
        step = step_of(child.name)
        if step is not None and child.is_dir():
            out[step] = child
    return out


def _subdirs(d: Path) -> list[str]:
    return sorted(c.name for c in d.iterdir() if c.is_dir()) if d.is_dir() else []


def find_dcp_dir(d: Path, subtree: str | None) -> DcpHit:
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
    numbered = [(int(m.group(1)), c) for c in (d.iterdir() if d.is_dir() else [])
                if c.is_dir() and (m := _MODEL_DIR_RE.fullmatch(c.name)) and _is_dcp(c)]
    if numbered:
        layout = "hf-trainer" if step_of(d.name) is not None else "accelerate"
        models = [c for _, c in sorted(numbered, key=lambda nc: nc[0])]
        return models[0], layout, subtree
    if _is_dcp(d / "weights"):
        return d / "weights", "nemo2", subtree
    ds = find_deepspeed_dir(d)
    if ds is not None:
        return ds, "deepspeed", subtree
    if d.is_dir() and any(d.glob("*.distcp")):
        raise IncompleteCheckpointError(
            f"{d / '.metadata'}: missing DCP metadata file beside {len(list(d.glob('*.distcp')))} .distcp shard(s); "
            "the save did not finish (DCP writes '.metadata' last). Use an earlier, complete checkpoint."
        )
    candidates = [c.name for c in d.iterdir() if c.is_dir() and _is_dcp(c) and "optim" not in c.name] if d.is_dir() else []
    if len(candidates) == 1:
        sub, kind, key = find_dcp_dir(d / candidates[0], subtree)
        return sub, ("dcp-subdir" if kind == "dcp" else kind), key
    if candidates:
        raise ConsolidationError(f"{d}: several DCP checkpoints inside: {sorted(candidates)}; pass --subtree NAME to pick one")
    raise IncompleteCheckpointError(
        f"{d}: no DCP checkpoint found (no '.metadata' here, nor in pytorch_model_fsdp_0/, weights/ or a step-N/ "
        f"subdirectory). Subdirectories present: {_subdirs(d) or 'none'}. Point SRC at a directory containing '.metadata'."
    )


def _open_step(d: Path, subtree: str | None) -> DcpHit | None:
    """:func:`find_dcp_dir` for a step directory, or None when its save is unfinished (no ``.metadata``)."""
    try:
        return find_dcp_dir(d, subtree)
    except IncompleteCheckpointError:
        return None


def _complete(found: dict[int, Path], subtree: str | None) -> list[int]:
    """The steps that hold a checkpoint that can be read (for error messages)."""
    out = []
    for s in sorted(found):
        try:
            if _open_step(found[s], subtree) is not None:
                out.append(s)
        except ConsolidationError:
            pass
    return out


def _missing_metadata(d: Path) -> Path:
    """The ``.metadata`` an incomplete step lacks: beside its ``.distcp`` files, else at its top."""
    for cand in [d, *sorted(c for c in d.iterdir() if c.is_dir())]:
        if any(cand.glob("*.distcp")):
            return cand / DCP_METADATA
    return d / DCP_METADATA


def _pick_steps(found: dict[int, Path], where: Path, subtree: str | None, step: int | None,
                average_last: int | None, steps: list[int] | None) -> tuple[list[int], list[DcpHit], list[str]]:
    """Return (steps, find_dcp_dir result per step, notes); the default is the newest *complete* step.

    Complete-looking steps whose files fail :func:`~fsdp_workflow.core.checkpoint_health.dcp_problem`
    (a truncated shard, a garbled ``.metadata``) are skipped with a note, as resume skips them;
    they are left where they are (the trainer, not the consolidator, sets them aside).
    """
    avail = sorted(found)
    if not avail:
        raise ConsolidationError(f"{where}: no step-N / checkpoint-N directories (found: {_subdirs(where) or 'nothing'})")
    if steps or step is not None:
        flag, wanted = ("--steps", list(steps)) if steps else ("--step", [step] if step is not None else [])
        missing = [s for s in wanted if s not in found]
        if missing:
            shown = missing if steps else step
            raise ConsolidationError(f"{flag} {shown}: not found in {where}; available steps are {avail}")
        hits: list[DcpHit] = []
        for s in wanted:
            hit = _open_step(found[s], subtree)
            if hit is None:
                raise IncompleteCheckpointError(
                    f"{flag} {s}: {_missing_metadata(found[s])} is missing, so {found[s]} is not a complete checkpoint "
                    "(DCP writes '.metadata' last: the save did not finish, or a copy is still in progress). "
                    f"Pick a complete step ({_complete(found, subtree) or 'none'}) or wait for the copy to finish."
                )
            hits.append(hit)
        return wanted, hits, []
    want = average_last or 1
    chosen: list[int] = []
    picked: list[DcpHit] = []
    skipped: list[int] = []
    corrupt: dict[int, str] = {}  # complete-looking steps whose files fail core.checkpoint_health
    for s in reversed(avail):
        hit = _open_step(found[s], subtree)
        if hit is None:
            skipped.append(s)
            continue
        # A tampered .metadata stays an error (the reader refuses it); DeepSpeed steps are checked by their reader.
        problem = dcp_problem(hit[0], report_unsafe=False) if _is_dcp(hit[0]) else None
        if problem is not None:
            corrupt[s] = problem
            continue
        chosen.insert(0, s)
        picked.insert(0, hit)
        if len(chosen) == want:
            break
    if not chosen and corrupt:
        raise ConsolidationError(
            f"{where}: no checkpoint that verifies: " + "; ".join(f"step {s}: {p}" for s, p in sorted(corrupt.items()))
            + ". Restore a good copy, or name one explicitly with --step to see its error.")
    if not chosen:
        raise IncompleteCheckpointError(
            f"{where}: no complete checkpoint: every step directory lacks '.metadata' "
            f"({', '.join(str(_missing_metadata(found[s])) for s in sorted(skipped))} missing). DCP writes '.metadata' "
            "last, so these saves did not finish or are still being copied; wait for a save to finish or point "
            "SRC at a finished checkpoint."
        )
    if len(chosen) < want:
        raise ConsolidationError(f"--average-last {average_last}: only {len(chosen)} steps in {where} are complete ({chosen})"
                                 + (f"; incomplete (no '.metadata'): {sorted(skipped)}" if skipped else ""))
    using = f"step {chosen[-1]}, the newest complete step" if want == 1 else f"the newest complete steps {chosen}"
    notes = [f"{found[s]}: skipped, {_missing_metadata(found[s])} is missing (an unfinished save or a copy in "
             f"progress); using {using}" for s in skipped]
    notes += [f"{found[s]}: skipped, it fails verification ({problem}); using {using}"
              for s, problem in sorted(corrupt.items())]
    return chosen, picked, notes


def _find_reference(start: Path, stop_levels: int = 4) -> Path | None:
    d = start
    for _ in range(stop_levels):
        for cand in (d / HF_ASSETS_DIR, d):
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
        hint = f"; give its directory: {src.parent}" if _is_dcp(src.parent) or _steps_in(src.parent / CHECKPOINTS_DIR) else ""
        raise ConsolidationError(f"{src}: source must be a checkpoint directory, not a file{hint}")
    container: Path | None = None
    layout: str | None = None
    if _steps_in(src / CHECKPOINTS_DIR) and not _is_dcp(src):
        container, layout = src / CHECKPOINTS_DIR, "project"
    elif _steps_in(src) and not _is_dcp(src):
        container = src
    multi = bool(steps or average_last)
    if container is None:
        if multi:
            raise ConsolidationError(f"{src}: --average-last/--steps need a directory of step-N checkpoints, but this is a single checkpoint")
        own = step_of(src.name)
        if step is not None and own != step:
            raise ConsolidationError(
                f"--step {step}: {src} is a single checkpoint{f' (step {own})' if own is not None else ''}, not a directory "
                f"of step-N checkpoints; point SRC at the directory holding {step_name(step)}/, or drop --step"
            )
        dcp_dir, kind, key = find_dcp_dir(src, subtree)
        if own is not None and kind == "dcp" and src.parent.name == CHECKPOINTS_DIR:
            kind = "project"
        elif own is not None and kind == "dcp":
            kind = "torchtitan-or-dcp"
        ref = reference or _find_reference(dcp_dir)
        return Resolved(kind, [dcp_dir], [own], ref, key)
    chosen, picked, notes = _pick_steps(_steps_in(container), container, subtree, step, average_last, steps)
    dirs: list[Path] = []
    kinds: set[str] = set()
    key = None
    for d, kind, key in picked:
        dirs.append(d)
        kinds.add(kind)
    if "deepspeed" in kinds:
        layout = "deepspeed" if len(kinds) == 1 else "mixed"
    if layout is None:
        layout = kinds.pop() if len(kinds) == 1 else "mixed"
        if layout == "dcp" and container.name == CHECKPOINTS_DIR:
            layout = "project"
    ref = reference or _find_reference(dirs[-1])
    return Resolved(layout, dirs, list(chosen), ref, key, notes)
