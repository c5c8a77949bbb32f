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
checkpoints, consolidation, containers). No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List

from fsdp_workflow.config.errors import ConfigError, Issue
from fsdp_workflow.config.schema import WorkflowConfig


@dataclass
class ValidationReport:
    """Everything :func:`validate` found: errors stop the run, warnings do not."""

    errors: List[Issue] = field(default_factory=list)
    warnings: List[Issue] = field(default_factory=list)

    def error(self, key: str, value: Any, why: str, fix: str) -> None:
        """Record a violation that must stop the run."""
        self.errors.append(Issue(key, value, why, fix))

    def warn(self, key: str, value: Any, why: str, fix: str) -> None:
        """Record a risk the user should know about; the run goes on."""
        self.warnings.append(Issue(key, value, why, fix))

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors

    def keys(self) -> List[str]:
        """The keys of every error, in the order found (handy in tests)."""
        return [i.key for i in self.errors]

    def raise_if_errors(self) -> None:
        """Raise one :class:`ConfigError` listing every error, if there is any.

        Raises:
            ConfigError: the config has at least one error.
        """
        if self.errors:
            raise ConfigError(self.errors)


Rule = Callable[[WorkflowConfig, ValidationReport], None]
BOUNDS_WHY = "must be "  # how rules_bounds starts every out-of-range message


def all_rules() -> List[Rule]:
    """Every rule, in the order its messages are reported."""
    from fsdp_workflow.config import rules_bounds, rules_env, rules_run, rules_strategy, rules_topology
    from fsdp_workflow.container.checks import check_container_steps  # images, binds, --nv

    return [*rules_bounds.RULES, *rules_topology.RULES, *rules_strategy.RULES, *rules_run.RULES,
            *rules_env.RULES, check_container_steps]


def validate(cfg: WorkflowConfig) -> ValidationReport:
    """Check every cross-field rule and collect every violation.

    Args:
        cfg: the typed config (``fsdp_workflow.config.load.to_typed``).

    Returns:
        A report with all errors and warnings; call ``raise_if_errors()`` on it.
    """
    report = ValidationReport()
    for rule in all_rules():
        rule(cfg, report)
    # One message per key: a bounds error ("must be >= 1") hides the consequences
    # other rules draw from the same bad value.
    out_of_bounds = {i.key for i in report.errors if i.why.startswith(BOUNDS_WHY)}
    report.errors = [i for i in report.errors if i.key not in out_of_bounds or i.why.startswith(BOUNDS_WHY)]
    return report
