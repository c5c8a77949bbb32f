"""Hydra's run mode without composing the whole config an extra time.

``@hydra.main`` composes every config twice: once only to read ``hydra.mode``
(``Hydra.get_mode``, composed in MULTIRUN mode), then again to run. With our
config tree that first composition is about a third of a dry run's time
(0.3 s of a 1 s ``python -m fsdp_workflow ... dry_run=true``), and it decides
nothing unless some config sets ``hydra.mode``: Hydra then takes the mode from
the command line (``-m`` or not), as it does here.

:func:`mode_from_flags` skips it only when no file of ``conf/`` can set that key
(none has a ``mode:`` line, none adds a search path) and the command line neither
sets it nor brings configs from elsewhere (``--config-dir``, ``--config-path``,
``--config-name``, ``hydra.searchpath``). Otherwise Hydra composes as it always does.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Sequence

from fsdp_workflow.config.load import CONF_DIR

# Command-line words after which a config outside conf/ (or hydra.mode itself) may be composed.
_ELSEWHERE_FLAGS = ("--config-path", "-cp", "--config-dir", "-cd", "--config-name", "-cn")
_MODE_LINE = re.compile(r"^\s*(mode|searchpath)\s*:", re.MULTILINE)


@lru_cache(maxsize=None)
def tree_may_set_mode(conf_dir: Path = CONF_DIR) -> bool:
    """Whether a YAML file of ``conf_dir`` has a ``mode:`` or ``searchpath:`` line (any depth)."""
    return any(_MODE_LINE.search(p.read_text(errors="replace")) for p in sorted(conf_dir.rglob("*.yaml")))


def mode_is_the_flags(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> bool:
    """True when ``hydra.mode`` can only be unset, so Hydra's mode is ``-m`` or not."""
    for arg in argv:
        if arg.split("=", 1)[0] in _ELSEWHERE_FLAGS or "hydra.mode" in arg or "searchpath" in arg:
            return False
    return not tree_may_set_mode(conf_dir)


@contextmanager
def mode_from_flags(argv: Sequence[str]) -> Iterator[bool]:
    """Within the block, ``Hydra.get_mode`` answers None without composing, when that is its answer anyway.

    Yields whether it does. Hydra then appends ``hydra.mode=RUN`` (or ``MULTIRUN`` under ``-m``)
    to the overrides, exactly as after a composition that found no mode.
    """
    from hydra._internal.hydra import Hydra

    original = getattr(Hydra, "get_mode", None)
    if original is None or not mode_is_the_flags(argv):
        yield False
        return
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield True
    finally:
        Hydra.get_mode = original  # type: ignore[method-assign]
