"""Cross-field rules of a composed config, checked before anything runs.

The schema catches unknown keys and wrong types at compose time; this module
catches combinations that compose fine but would fail (or silently do
something else) minutes into a job on a busy cluster. Every rule runs, and
every violation is collected before anything is reported::

    report = validate(cfg)
    for w in report.warnings:
        print("warning:", w.format(), file=sys.stderr)
    report.raise_if_errors()   # ConfigError listing every error

The rules live in ``rules_strategy`` (FSDP / DeepSpeed / optimizer / precision),
``rules_topology`` (world size, batch, Slurm) and ``rules_run`` (paths,
checkpoints, consolidation, containers), ``rules_eval`` (evaluations that measure nothing), ``rules_model`` (the model directory), ``rules_float8`` (train.float8), ``rules_trackers``
(train.report_to) and ``rules_profile`` (train.profile_steps). No torch
import here.
"""

from __future__ import annotations

from typing import List, Sequence

from fsdp_workflow.config import (
    rules_bounds,
    rules_env,
    rules_eval,
    rules_finite,
    rules_float8,
    rules_model,
    rules_profile,
    rules_run,
    rules_strategy,
    rules_topology,
    rules_trackers,
)
from fsdp_workflow.config.rules_finite import NONFINITE_WHY
from fsdp_workflow.config.errors import BOUNDS_WHY, ConfigError, Issue, Rule, ValidationReport
from fsdp_workflow.config.schema import WorkflowConfig

__all__ = ["ConfigError", "Issue", "Rule", "ValidationReport", "all_rules", "validate"]


def all_rules() -> List[Rule]:
    """Every rule of the config stage, in the order its messages are reported."""
    return [*rules_finite.RULES, *rules_bounds.RULES, *rules_topology.RULES, *rules_strategy.RULES, *rules_run.RULES,
            *rules_eval.RULES,
            *rules_model.RULES,
            *rules_env.RULES, *rules_float8.RULES, *rules_trackers.RULES, *rules_profile.RULES]


def validate(cfg: WorkflowConfig, extra_rules: Sequence[Rule] = ()) -> ValidationReport:
    """Check every cross-field rule and collect every violation.

    The stages above config add their own rules through ``extra_rules`` (the
    container stage checks images and binds; see :func:`fsdp_workflow.plan.checks.check`),
    so config never imports them and all messages still come in one report.

    Args:
        cfg: the typed config (``fsdp_workflow.config.load.to_typed``).
        extra_rules: rules run after the config stage's own.

    Returns:
        A report with all errors and warnings; call ``raise_if_errors()`` on it.
    """
    report = ValidationReport()
    for rule in [*all_rules(), *extra_rules]:
        rule(cfg, report)
    # One message per key: a bounds error ("must be >= 1") hides the consequences
    # other rules draw from the same bad value.
    out_of_bounds = {i.key for i in report.errors if i.why.startswith(BOUNDS_WHY)}
    report.errors = [i for i in report.errors if i.key not in out_of_bounds or i.why.startswith(BOUNDS_WHY)]
    # A non-finite value likewise hides what the other rules (bounds included) make of it.
    nonfinite = {i.key for i in report.errors if i.why.startswith(NONFINITE_WHY)}
    report.errors = [i for i in report.errors if i.key not in nonfinite or i.why.startswith(NONFINITE_WHY)]
    return report
