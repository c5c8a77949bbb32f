"""Exceptions raised by the consolidator."""

from __future__ import annotations


class ConsolidationError(ValueError):
    """A failure the user can fix: a bad path, a broken checkpoint, a bad option.

    The message names the file or key, the value found and the fix. The CLI prints it
    without a traceback and exits with status 2.
    """


class UnsafeCheckpointError(ConsolidationError):
    """A pickle in the checkpoint references something outside the allowed set."""


class IncompleteCheckpointError(ConsolidationError):
    """A checkpoint directory whose save did not finish: no ``.metadata`` (DCP writes it last)."""


class OutputExistsError(ConsolidationError):
    """OUT exists and ``--overwrite`` was not given; the CLI adds the command that replaces it."""


class ConsolidationInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a consolidation; the message says what was left (the CLI exits 130)."""
