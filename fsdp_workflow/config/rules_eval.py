"""Evaluation rules: settings that ask for an evaluation which can never measure anything.

Held-out evaluation runs in two places: in the training loop every
``train.eval_every_steps`` steps (``eval_loss`` in ``metrics.jsonl``), and per saved
checkpoint on Slurm (``consolidate.every_checkpoint``, ``evals.jsonl``). Both read the
held-out split the prepare step writes: ``data.eval_path``, or ``data.eval_fraction``
of the training documents; synthetic data always has one. These are warnings, not
errors: the run trains as asked, but the evaluation asked for measures nothing.

Whether the eval files are the training files is the plan stage's to check (it reads
the files: :func:`fsdp_workflow.plan.inputs.check_eval_data`); whether the held-out
split is empty or smaller than one evaluation, the prepare step's (it counts it).
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.schema import ClusterKind, DataSource, WorkflowConfig


def has_held_out(cfg: WorkflowConfig) -> bool:
    """Whether the prepare step will write a held-out split (synthetic data always has one)."""
    d = cfg.data
    synthetic = d.source == DataSource.synthetic and not d.sources
    return synthetic or bool(d.eval_path) or d.eval_fraction > 0


def check_evaluation(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Warn about evaluation settings that cannot evaluate anything."""
    t, d = cfg.train, cfg.data
    every_checkpoint = cfg.consolidate.every_checkpoint and cfg.cluster.kind == ClusterKind.slurm
    if t.eval_every_steps > t.max_steps:
        r.warn("train.eval_every_steps", t.eval_every_steps,
               f"longer than the run (train.max_steps={t.max_steps}): the training loop never reaches an "
               "evaluation step, so metrics.jsonl gets no eval_loss",
               f"train.eval_every_steps={max(t.max_steps // 10, 1)} (or 0 for no in-loop evaluation)")
    if not has_held_out(cfg):
        asked = [k for k, on in (("train.eval_every_steps", t.eval_every_steps > 0),
                                 ("consolidate.every_checkpoint", every_checkpoint)) if on]
        for key in asked:
            value = t.eval_every_steps if key == "train.eval_every_steps" else True
            what = ("the training loop has nothing to evaluate on and logs no eval_loss"
                    if key == "train.eval_every_steps" else
                    "every checkpoint's evaluation job records 'skipped' (no held-out data) in evals.jsonl")
            r.warn(key, value,
                   f"there is no held-out data (data.eval_path=null, data.eval_fraction={d.eval_fraction:g}): {what}",
                   "data.eval_fraction=0.05 (hold out 5% of the documents) or data.eval_path=/path/to/heldout.jsonl"
                   f" (or {key}={'0' if key == 'train.eval_every_steps' else 'false'})")
    if d.eval_path and t.eval_every_steps == 0 and not every_checkpoint:
        r.warn("data.eval_path", d.eval_path,
               "nothing evaluates on it during the run (train.eval_every_steps=0, no per-checkpoint evaluation "
               "on Slurm): it is prepared and read only by a hand-run `python -m fsdp_workflow.evaluate`",
               "train.eval_every_steps=N (evaluate every N steps), or consolidate.every_checkpoint=true on "
               "cluster=slurm; or drop data.eval_path")


RULES: List[Rule] = [check_evaluation]
