"""Check the consolidator's options before anything is read, as strictly as the planner does.

Every mistake found is reported at once, each naming the flag, the value given, why it is
refused and what to pass instead. The CLI prints the message and exits with status 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from fsdp_workflow.core.modeldir import VERIFICATION_FILE
from fsdp_workflow.core.sizes import parse_size

from .casting import CLI_DTYPES
from .consolidation_errors import ConsolidationError, OutputExistsError
from .in_place import in_place_problem, is_empty



def check_options(
    out: Path,
    *,
    dtype: str | None,
    max_shard_size: str | int,
    step: int | None,
    average_last: int | None,
    steps: list[int] | None,
    weights: list[float] | None,
    remove_sharded: bool,
    verify: bool,
    workers: int | None,
    overwrite: bool = False,
) -> int:
    """Validate the options of :func:`~.api.consolidate` that need no checkpoint to judge.

    Args:
        out: The output directory.
        dtype, max_shard_size, step, average_last, steps, weights, remove_sharded, verify,
            workers, overwrite: As passed to :func:`~.api.consolidate`.

    Returns:
        ``max_shard_size`` in bytes.

    Raises:
        OutputExistsError: ``out`` exists (without ``overwrite``) and nothing else is wrong.
        ConsolidationError: One or more options are invalid; the message lists them all.
    """
    exists = out_exists_problem(out, overwrite)
    errors = [exists] if exists else _check_out_parent(out)
    unwritable = in_place_problem(out) if not exists else None
    if unwritable:
        errors.append(unwritable)
    if dtype is not None and dtype not in CLI_DTYPES:
        errors.append(f"--dtype {dtype!r}: choose one of bf16, fp16, fp32 (or leave it out to keep stored dtypes)")
    max_bytes = 0
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        errors.append(f"--max-shard-size {max_shard_size}: {exc}; e.g. --max-shard-size 5GB")
    errors += _check_selection(step, average_last, steps, weights)
    if remove_sharded and not verify:
        errors.append(
            "--remove-sharded with --no-verify: refusing to delete the source checkpoint after an unverified "
            "consolidation (the planner refuses consolidate.remove_sharded=true with consolidate.verify=false too); "
            "drop --no-verify, or drop --remove-sharded and delete the shards yourself once you have checked OUT"
        )
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        errors.append(f"--workers {workers}: must be a whole number of threads, at least 1 (leave it out for min(8, 2 x CPUs))")
    if errors == [exists]:
        raise OutputExistsError(exists)
    if len(errors) == 1:
        raise ConsolidationError(errors[0])
    if errors:
        raise ConsolidationError(f"found {len(errors)} problems with the options:\n  - " + "\n  - ".join(errors))
    return max_bytes


def is_earlier_output(out: Path) -> bool:
    """Whether ``out`` is a model directory this tool wrote (it holds ``verification.json``)."""
    return out.is_dir() and not out.is_symlink() and (out / VERIFICATION_FILE).is_file()


def out_exists_problem(out: Path, overwrite: bool) -> str | None:
    """Why an existing ``out`` may not be written, or None (it does not exist, or ``overwrite`` replaces it).

    An earlier output of this tool and any other directory are both replaced only with
    ``--overwrite``, and only once the new model is verified (:func:`~.steps.commit_output`);
    a file or a symlink at ``out`` is never replaced. An empty directory (a fresh mount
    point, a ``mkdir`` beforehand) holds nothing to lose: it is written without ``--overwrite``.

    Args:
        out: The output directory.
        overwrite: The user passed ``--overwrite``.

    Returns:
        The message, naming ``out`` and the fix, or None.
    """
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        kind = "a symlink" if out.is_symlink() else "a file"
        return (f"{out}: OUT is {kind}, not a model directory; it is never replaced (not even with --overwrite). "
                "Choose another OUT, or remove it yourself")
    if not out.exists() or overwrite or is_empty(out):
        return None
    if is_earlier_output(out):
        return (f"{out}: OUT holds an earlier consolidation (it has {VERIFICATION_FILE}); pass --overwrite to replace "
                "it once the new model is verified, or choose a new OUT")
    return (f"{out}: OUT exists and is not a model written by this tool (no {VERIFICATION_FILE} in it); choose a new "
            "OUT, or pass --overwrite to replace it and everything in it once the new model is verified")


def _check_out_parent(out: Path) -> list[str]:
    if out.exists():
        return []  # replaced with --overwrite: its parent holds it already
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return [f"{out}: cannot create OUT there, {parent} is a file, not a directory; choose an OUT under a directory"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"{out}: cannot create OUT there, {parent} is not writable by this user; choose an OUT you can write"]
    return []


def _check_selection(step: int | None, average_last: int | None, steps: list[int] | None,
                     weights: list[float] | None) -> list[str]:
    """Step choice and averaging weights; the steps themselves are looked up in :mod:`.layout`."""
    errors = []
    given = [flag for flag, v in (("--step", step), ("--average-last", average_last), ("--steps", steps)) if v is not None]
    if len(given) > 1:
        errors.append(f"{' and '.join(given)}: give only one of --step, --average-last and --steps")
    if average_last is not None and average_last < 1:
        errors.append(f"--average-last {average_last}: must be at least 1 (1 is the newest step alone; K averages the last K)")
    if steps is not None:
        if not steps:
            errors.append("--steps: no step numbers given; list them like --steps 800,900,1000")
        dupes = sorted({s for s in steps if steps.count(s) > 1})
        if dupes:
            errors.append(f"--steps {','.join(map(str, steps))}: step(s) {dupes} listed twice; list each once "
                          "and use --weights to weigh one more")
    if weights is None:
        return errors
    n = len(steps) if steps else (average_last or 0)
    if steps is None and average_last is None:
        errors.append(f"--weights {','.join(map(str, weights))}: weights are only used when averaging; "
                      "add --steps A,B or --average-last K, or drop --weights")
    elif n >= 1 and len(weights) != n:
        flag = "--steps" if steps else f"--average-last {average_last}"
        errors.append(f"--weights has {len(weights)} values but {n} checkpoints are averaged ({flag}); give one weight per step")
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        errors.append(f"--weights {','.join(map(str, weights))}: weights must be finite, non-negative and sum to more "
                      "than 0, e.g. --weights 1,3")
    return errors
