"""User-facing config problems: one :class:`Issue` per violated rule.

Every issue names the dotted key, the value found, why it is a problem and the
fix (the override to type, where there is one). :class:`ConfigError` carries
all of them at once, so a user fixes a config in one pass, not one error per
run. The CLI prints the message and exits with ``EXIT_USAGE`` (2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, List, Sequence

if TYPE_CHECKING:  # the schema imports nothing from here; the alias only names it
    from fsdp_workflow.config.schema import WorkflowConfig


def show_value(value: Any) -> str:
    """Render a config value the way a user would type it in an override."""
    if isinstance(value, Enum):
        return str(value.value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)


@dataclass(frozen=True)
class Issue:
    """One violated rule.

    Attributes:
        key: dotted config key, e.g. ``optimizer.name``.
        value: the value found there.
        why: why it is wrong (or risky, for a warning).
        fix: what to do, ideally the exact override to type.
    """

    key: str
    value: Any
    why: str
    fix: str

    def format(self) -> str:
        """One readable block: key and value, then why, then the fix."""
        return f"{self.key} = {show_value(self.value)}\n    why: {self.why}\n    fix: {self.fix}"


class ConfigError(ValueError):
    """The config breaks one or more rules; ``issues`` holds every one of them."""

    def __init__(self, issues: Sequence[Issue]) -> None:
        self.issues = list(issues)
        n = len(self.issues)
        noun = "problem" if n == 1 else "problems"
        blocks = "\n".join(f"  {i}. {issue.format()}" for i, issue in enumerate(self.issues, 1))
        super().__init__(f"found {n} {noun} in the config:\n{blocks}")


@dataclass
class ValidationReport:
    """Everything :func:`validate` found: errors stop the run, warnings do not; notes say what planning decided."""

    errors: List[Issue] = field(default_factory=list)
    warnings: List[Issue] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # e.g. the model directory's values that replaced the config's

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


Rule = Callable[["WorkflowConfig", ValidationReport], None]  # one check: adds issues to the report
BOUNDS_WHY = "must be "  # how rules_bounds starts every out-of-range message
