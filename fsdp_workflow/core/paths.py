"""Where an output directory may go relative to the checkpoints it is made from.

One rule, shared by the planner (``consolidate.output_dir`` against ``RUN_DIR/checkpoints``,
:mod:`fsdp_workflow.config.rules_run`) and the consolidation CLI (``OUT`` against the
checkpoint directories it reads, :mod:`fsdp_workflow.consolidate.source`), so the two can
never disagree again: an output inside the checkpoints would be read as a checkpoint, pruned,
or deleted with them by ``--remove-sharded``; an output that holds the checkpoints would be
replaced with them inside it.

Paths are compared after ``~`` expansion and symlink resolution (``os.path.realpath``, which
also works for paths that do not exist yet), so a symlink cannot hide one from the other.
Nothing here touches the disk beyond reading links.
"""

from __future__ import annotations

import os
from typing import Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


def real(path: PathLike) -> str:
    """``path`` made absolute, ``~`` expanded and symlinks resolved, as the rules compare it."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def is_inside(path: PathLike, parent: PathLike) -> bool:
    """True when ``path`` is ``parent`` or lies somewhere below it.

    Args:
        path: The path that may be inside.
        parent: The directory that may hold it.

    Returns:
        Whether ``path`` equals ``parent`` or is a descendant of it (after :func:`real`).
    """
    a, b = real(path), real(parent)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def output_overlap(out: PathLike, source: PathLike) -> Optional[str]:
    """Why ``out`` may not be written for checkpoints read from ``source``, or None when it may.

    Args:
        out: The output directory (it need not exist).
        source: A checkpoint directory the output is made from (or the directory of
            checkpoints, e.g. ``RUN_DIR/checkpoints``).

    Returns:
        None when the two are apart; otherwise a phrase naming both paths, to follow the
        output path in a message ("is inside ...", "holds ...").
    """
    if not str(out).strip():
        return "is an empty path"
    if is_inside(out, source):
        same = real(out) == real(source)
        return (f"is the checkpoint directory {source} itself" if same else
                f"is inside the checkpoint directory {source}: the model would be written among the checkpoints "
                "(read as one, pruned, or deleted with them by --remove-sharded)")
    if is_inside(source, out):
        return (f"holds the checkpoint directory {source}: writing or replacing it would put the model over the "
                "checkpoints it is made from")
    return None
