"""User-facing config problems: one :class:`Issue` per violated rule.

Every issue names the dotted key, the value found, why it is a problem and the
fix (the override to type, where there is one). :class:`ConfigError` carries
all of them at once, so a user fixes a config in one pass, not one error per
run. The CLI prints the message and exits with ``EXIT_USAGE`` (2).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence


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
