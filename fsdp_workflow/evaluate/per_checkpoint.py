"""Evaluate one saved checkpoint: consolidate it in-process, measure held-out perplexity, clean up.

With an EMA of the weights (``train.ema_decay``) a checkpoint holds two models under two
key roots (:data:`~fsdp_workflow.core.rundir.MODEL_KEY`, :data:`~fsdp_workflow.core.rundir.EMA_KEY`):
each is consolidated and measured on the same tokens. The consolidated models are
temporary (one per checkpoint would fill the disk): they are removed whatever happens.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional

from fsdp_workflow.consolidate import ConsolidationError, consolidate
from fsdp_workflow.core.modeldir import VERIFICATION_FILE
from fsdp_workflow.core.rundir import EMA_KEY, MODEL_KEY, QUARANTINE_SUFFIX, step_name
from fsdp_workflow.train.heldout import DataError

from .perplexity import Measured, perplexity
from .eval_record import FAILED, OK, SKIPPED, EvalRecord
from .run import EvalRun

_TAIL = 500  # characters of an error kept in the record


class NoSuchCheckpoint(ValueError):
    """STEP names no checkpoint the run has, had, or set aside: a wrong argument, not a pruned step."""


def could_have_saved(run: EvalRun, step: int) -> bool:
    """Whether the run saved (or, for a run without ``saves.jsonl``, can have saved) ``step-STEP``.

    The trainer records each commit in ``saves.jsonl``. A run written before that record
    falls back to the save rule: a checkpoint every ``checkpoint.every_steps`` steps, one at
    ``train.max_steps``, and the one ``train_exit.json`` names (a preemption's save).
    """
    if run.saved is not None:
        return step in run.saved
    every, cfg = run.cfg.checkpoint.every_steps, run.cfg
    return step >= 1 and ((every > 0 and step % every == 0) or step == cfg.train.max_steps or step == run.exit_saved)


def _steps(steps: List[int]) -> str:
    """``step-2, step-4 ... step-98, step-100``: a long list kept to its ends."""
    names = [step_name(s) for s in steps]
    return ", ".join(names) if len(names) <= 10 else ", ".join(names[:3]) + " ... " + ", ".join(names[-5:])


def _never_saved(run: EvalRun, step: int) -> NoSuchCheckpoint:
    layout, cfg = run.layout, run.cfg
    every = cfg.checkpoint.every_steps
    rule = (f"checkpoint.every_steps={every}: a checkpoint every {every} steps and one at the final step, "
            f"train.max_steps={cfg.train.max_steps}" if every > 0 else
            f"checkpoint.every_steps=0: only the final step, train.max_steps={cfg.train.max_steps}")
    if run.saved is not None:
        what = (f"this run saved {_steps(sorted(set(run.saved)))} ({rule}; {layout.saves})" if run.saved
                else f"this run has saved no checkpoint yet ({rule})")
    else:  # a run from before saves.jsonl: the rule alone says which steps it can have saved
        what = f"this run saves by the rule {rule}, and step {step} is not one of them"
    held = [s for s, _ in layout.list_checkpoints()]
    example = held[-1] if held else (sorted(run.saved)[-1] if run.saved else "STEP")
    return NoSuchCheckpoint(f"{layout.step_dir(step)}: step {step} was never saved: {what}. Nothing was recorded; "
                            f"give a saved step, e.g. `python -m fsdp_workflow.evaluate {layout.root} {example}`")


def why_absent(run: EvalRun, step: int) -> str:
    """Why ``step-STEP`` (and its snapshot) is gone, when the run can explain it.

    An evaluation job queued behind training may find its checkpoint pruned by
    ``checkpoint.keep_last`` (a newer one exists then), set aside as damaged
    (``step-N.corrupt``), or removed after the final consolidation
    (``consolidate.remove_sharded``): the record then says so and the job succeeds.
    Anything else is the caller's mistake: a step the run never saved
    (:func:`could_have_saved`), or a saved step that nothing above explains.

    Raises:
        NoSuchCheckpoint: naming the steps the run saved (or holds) and the save interval.
    """
    layout = run.layout
    name = layout.step_dir(step).name + QUARANTINE_SUFFIX
    if any(p.name == name or p.name.startswith(name + "-") for p in layout.quarantined()):
        return f"{layout.step_dir(step)} was set aside as damaged ({name}): there is nothing to evaluate"
    if not could_have_saved(run, step):
        raise _never_saved(run, step)
    held = [s for s, _ in layout.list_checkpoints()]
    if any(s > step for s in held):
        return f"{layout.step_dir(step)} is gone (pruned by keep_last before this job ran)"
    if run.cfg.consolidate.remove_sharded and (layout.hf_model / VERIFICATION_FILE).is_file():
        return f"{layout.step_dir(step)} was removed after its verified consolidation (consolidate.remove_sharded=true)"
    holds = ", ".join(step_name(s) for s in held) or "no complete checkpoint yet"
    raise NoSuchCheckpoint(f"{layout.step_dir(step)}: no such checkpoint ({layout.checkpoints} holds {holds}); "
                           f"give the step of one of them, e.g. `python -m fsdp_workflow.evaluate {layout.root} "
                           f"{held[-1] if held else 'STEP'}`")


def checkpoint_source(run: EvalRun, step: int) -> Optional[Path]:
    """The hard-linked snapshot ``post_checkpoint.sh`` made (immune to pruning), else the checkpoint itself.

    Args:
        run: the run.
        step: the checkpoint's step.

    Returns:
        The directory to consolidate, or None when both are gone.
    """
    for cand in (run.layout.eval_snapshot(step), run.layout.step_dir(step)):
        if cand.is_dir():
            return cand
    return None


def evaluate_checkpoint(run: EvalRun, step: int, job_id: Optional[str] = None) -> EvalRecord:
    """Consolidate ``step-STEP`` (and its EMA) under ``evals/``, measure each, remove them.

    Args:
        run: the run (config and layout).
        step: the checkpoint's step.
        job_id: the evaluation job's Slurm id, recorded as is.

    Returns:
        The record for ``evals.jsonl``: ``ok`` with the figures, ``skipped`` (checkpoint
        pruned, set aside or removed, see :func:`why_absent`; no held-out data) or ``failed``
        (consolidation failed, data not prepared), with the reason. The snapshot the job
        read is removed afterwards.

    Raises:
        NoSuchCheckpoint: the run never had ``step-STEP`` (nothing to record).
    """
    layout, t0 = run.layout, time.time()
    record: EvalRecord = {"step": step, "job_id": job_id}
    src = checkpoint_source(run, step)
    if src is None:
        record.update(status=SKIPPED, reason=why_absent(run, step))
        return record
    models: Dict[str, tuple[Path, Optional[str]]] = {"": (layout.eval_model(step), None)}
    if run.cfg.train.ema_decay is not None:  # two models in one checkpoint: name each one's key root
        models = {"": (layout.eval_model(step), MODEL_KEY), "ema_": (layout.eval_model_ema(step), EMA_KEY)}
    results: Dict[str, Optional[Measured]] = {}
    try:
        reference = layout.hf_assets if (layout.hf_assets / "config.json").is_file() else None
        for prefix, (out, subtree) in models.items():
            if out.exists():
                shutil.rmtree(out)  # left by an earlier attempt of this job
            out.parent.mkdir(parents=True, exist_ok=True)
            consolidate(src, out, max_shard_size=run.cfg.consolidate.max_shard_size, verify=False, progress=False,
                        reference=reference, subtree=subtree)
            results[prefix] = perplexity(out, run.cfg)
            shutil.rmtree(out, ignore_errors=True)
    except ConsolidationError as err:
        record.update(status=FAILED, reason=f"consolidation failed: {str(err)[-_TAIL:]}")
        return record
    except DataError as err:
        record.update(status=FAILED, reason=f"no held-out data to read: {str(err)[-_TAIL:]}")
        return record
    finally:
        for out, _ in models.values():
            shutil.rmtree(out, ignore_errors=True)
        if src == layout.eval_snapshot(step):
            shutil.rmtree(src, ignore_errors=True)
    main = results[""]
    if main is None:
        record.update(status=SKIPPED, reason="no held-out data (data.eval_path / data.eval_fraction)")
    else:
        record.update(status=OK, loss=main["loss"], perplexity=main["perplexity"], num_tokens=main["num_tokens"])
        ema = results.get("ema_")
        if ema is not None:
            record.update(ema_loss=ema["loss"], ema_perplexity=ema["perplexity"])
    record["seconds"] = round(time.time() - t0, 2)
    return record
