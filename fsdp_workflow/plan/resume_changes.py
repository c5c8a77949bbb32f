"""What a resume under another topology or ``train.seq_len`` changes, said once at planning (issue 49, item 7).

A checkpoint keeps the data position as the number of packed samples consumed
(:mod:`fsdp_workflow.train.data`), and the step. Resumed with other ranks, another
``strategy.context_parallel_size`` (or tensor parallel size) or another micro-batch or
accumulation, each step takes another number of sequences: the global batch changes
from that step on, and with it the tokens per step and what ``train.max_steps`` covers.
Resumed with another ``train.seq_len``, the data is packed again: the saved position
counts samples of the old packing, so in the new one it lands elsewhere in the
documents (some trained again, others skipped this epoch). Both ran without a word.

:func:`check_resume` reads the config recorded beside the checkpoint once (``RUN/config.yaml`` of
``checkpoint.resume=RUN/checkpoints/step-N``); :func:`check_resume_changes` compares the config with it and
warns once, on ``checkpoint.resume``, naming each change and how to keep the old
batch. It reads that one YAML file: no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import WorkflowConfig, data_parallel_size, world_size
from fsdp_workflow.core.rundir import CHECKPOINTS_DIR, CONFIG_FILE, RunDir, parse_step

_NOT_A_PATH = ("", "auto", "none")  # auto resumes the same config (the run_dir rule refuses another)


def _checkpoint_run(resume: str) -> Optional[Tuple[Path, Optional[int]]]:
    """The run directory a ``checkpoint.resume`` path belongs to, and the step it names (None: its newest)."""
    if resume.strip().lower() in _NOT_A_PATH:
        return None
    path = Path(resume.strip())
    if path.parent.name == CHECKPOINTS_DIR and (path.parent.parent / CONFIG_FILE).is_file():
        return path.parent.parent, parse_step(path.name)
    if (path / CONFIG_FILE).is_file():  # the run directory itself: its newest checkpoint
        found = RunDir.of(str(path)).list_checkpoints()
        return path, (found[-1][0] if found else None)
    return None


def _batch(cfg: WorkflowConfig) -> Tuple[int, str]:
    """The global batch in sequences, and how it is made (``micro 2 x accum 1 x dp 2 of 4 ranks / cp 2``)."""
    t, s = cfg.train, cfg.strategy
    dp = data_parallel_size(cfg)
    split = [f"{name} {size}" for name, size in (("cp", s.context_parallel_size), ("tp", s.tensor_parallel_size))
             if size > 1]
    n = world_size(cfg)
    ranks = f" of {n} rank{'s' if n != 1 else ''}" + (f" / {' x '.join(split)}" if split else "")
    return t.micro_batch_size * t.grad_accum_steps * dp, \
        f"micro {t.micro_batch_size} x accum {t.grad_accum_steps} x dp {dp}{ranks}"


def resume_changes(old: WorkflowConfig, new: WorkflowConfig, step: Optional[int]) -> Tuple[List[str], List[str]]:
    """What resuming ``old``'s checkpoint under ``new`` changes, and the overrides that would keep it.

    Args:
        old: the config recorded beside the checkpoint.
        new: the config about to be planned.
        step: the checkpoint's step (None when unknown).

    Returns:
        ``(changes, fixes)``: one sentence per change (empty when nothing changes), and overrides.
    """
    changes: List[str] = []
    fixes: List[str] = []
    at = f"step {step}" if step is not None else "the checkpoint's step"
    (was, was_made), (now, now_made) = _batch(old), _batch(new)
    if was != now:
        changes.append(f"the global batch changes from {was} sequences ({was_made}) to {now} ({now_made}) from "
                       f"{at} on: the data position carries on from the samples consumed, each step now takes "
                       f"{now} of them, and the remaining steps to train.max_steps={new.train.max_steps} cover "
                       f"{now / was:.3g}x the data they would have")
        per_accum = new.train.micro_batch_size * data_parallel_size(new)
        if was % per_accum == 0:
            fixes.append(f"train.grad_accum_steps={was // per_accum}")  # the old global batch on this topology
    if old.train.seq_len != new.train.seq_len:
        changes.append(f"train.seq_len changes from {old.train.seq_len} to {new.train.seq_len}: the data is packed "
                       f"again into {new.train.seq_len}-token samples, so the data position (samples of the "
                       f"{old.train.seq_len}-token packing) lands elsewhere in the documents: some are trained again "
                       "and others skipped in this epoch; tokens per step go from "
                       f"{was * old.train.seq_len:,} to {now * new.train.seq_len:,}")
        fixes.append(f"train.seq_len={old.train.seq_len}")
    return changes, fixes


def _resumed_run(cfg: WorkflowConfig) -> Optional[Tuple[Path, Optional[int], WorkflowConfig]]:
    """The run ``checkpoint.resume`` continues, the step it names and that run's recorded config (read once).

    None when it names no run directory, or its ``config.yaml`` does not load (another version's
    or a hand-edited record: nothing to compare with; the trainer compares the weights).
    """
    found = _checkpoint_run(cfg.checkpoint.resume or "")
    if found is None:
        return None
    root, step = found
    try:
        return root, step, load_run_config(root)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def check_resume(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The planning rules of a resume onto a recorded run: its model's shape, then what else changed."""
    resumed = _resumed_run(cfg)
    if resumed is not None:
        check_resume_model(cfg, r, *resumed)
        check_resume_changes(cfg, r, *resumed)


def check_resume_changes(cfg: WorkflowConfig, r: ValidationReport, root: Path, step: Optional[int],
                         old: WorkflowConfig) -> None:
    """Warn once when ``checkpoint.resume`` continues a run with another global batch or ``train.seq_len``."""
    changes, fixes = resume_changes(old, cfg, step)
    if not changes:
        return
    r.warn("checkpoint.resume", cfg.checkpoint.resume,
           f"resumes the run of {root / CONFIG_FILE} on another shape: " + "; ".join(changes),
           ("to continue as that run trained: " + " ".join(fixes) + "; " if fixes else "")
           + "to change it on purpose, nothing")


# The model keys that set the weights' names and shapes (after the model directory filled them in):
# the checkpoint's weights cannot load into another value of any (the trainer's model_problem).
SHAPE_KEYS = ("model_type", "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def check_resume_model(cfg: WorkflowConfig, r: ValidationReport, root: Path, step: Optional[int],
                       old: WorkflowConfig) -> None:
    """Refuse a resume onto a model of another shape at planning, before ``config.yaml`` is rewritten.

    The trainer refused it too (:func:`fsdp_workflow.train.resume.model_problem`), but only after
    the planner had recorded the new config: ``status`` then offered a resume command repeating
    the refused override. Here nothing is written, and the fix names the recorded value.
    """
    where = f"{root / CHECKPOINTS_DIR}/step-{step}" if step is not None else str(root)
    for key in SHAPE_KEYS:
        was, now = getattr(old.model, key), getattr(cfg.model, key)
        if was != now:
            shown = str(was).lower() if isinstance(was, bool) else was
            r.error(f"model.{key}", now,
                    f"checkpoint.resume continues {where}, whose weights were trained with model.{key}={shown} "
                    f"({root / CONFIG_FILE}); the weights come from the checkpoint on resume and cannot load into "
                    "this shape",
                    f"model.{key}={shown} to resume that run, or a new model in a new run directory "
                    f"(run_dir={root}-2 checkpoint.resume=auto)")


__all__ = ["SHAPE_KEYS", "check_resume", "check_resume_changes", "check_resume_model", "resume_changes"]
