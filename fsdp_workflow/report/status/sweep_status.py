"""``python -m fsdp_workflow.status SWEEP_DIR``: one line per point of a sweep.

Reads the sweep's ``sweep.json`` (written by ``python -m fsdp_workflow -m ...``)
and each point's run directory through :func:`~fsdp_workflow.report.status.collect.collect`:
the state of its chain, the last logged step and loss, and its evaluation loss
(the last per-checkpoint evaluation, else the trainer's last in-loop eval). The
point with the lowest evaluation loss is marked best; with no evaluation at all
nothing is marked (a training loss would only reward overfitting).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fsdp_workflow.config.record import RunRecord, open_run
from fsdp_workflow.core.exit_codes import EXIT_INTERRUPTED, EXIT_REQUEUE, EXIT_TERMINATED, EXIT_USAGE
from fsdp_workflow.core.rundir import CONFIG_FILE, read_sweep_index
from fsdp_workflow.report.curves import series_of
from fsdp_workflow.report.status.collect import RunStatus, collect
from fsdp_workflow.report.status.paste_commands import shell, status_argv

# The chain's jobs, in order.
_CHAIN = ("prepare", "train", "consolidate")
_MAX_CELL = 40  # the widest value shown in a column (a longer one keeps the part that differs)


@dataclass
class PointStatus:
    num: int
    point: str  # the overrides that vary across the sweep ("optimizer.lr=2e-05")
    run_dir: str
    state: str  # planned, queued, running, requeued, done, failed, cancelled, dry run, ...
    step: Optional[int] = None
    max_steps: Optional[int] = None
    loss: Optional[float] = None
    eval_loss: Optional[float] = None
    best: bool = False
    jobs: Dict[str, str] = field(default_factory=dict)
    values: Dict[str, str] = field(default_factory=dict)  # each varying key's value at this point (the columns)


def _varying(points: List[dict]) -> List[List[str]]:
    """Each point's overrides that are not the same for every point (all of them when there is one point)."""
    lists = [[str(o) for o in p.get("overrides") or []] for p in points]
    common = set.intersection(*map(set, lists)) if len(lists) > 1 else set()
    return [[o for o in ov if o not in common] for ov in lists]


def _key_value(override: str) -> Tuple[str, str]:
    """``optimizer.lr=1e-3`` -> (``optimizer.lr``, ``1e-3``); ``+x=1`` and ``~x`` name ``x``."""
    key, sep, value = override.partition("=")
    return key.lstrip("+~"), (value if sep else "(removed)" if override.startswith("~") else "(set)")


def _columns(varying: List[List[str]]) -> Tuple[List[str], List[Dict[str, str]]]:
    """The keys whose value differs between points (in the order they are given), and each point's values."""
    rows = [dict(_key_value(o) for o in ov) for ov in varying]
    keys: List[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    return keys, [{k: row.get(k, "-") for k in keys} for row in rows]


def _shown(values: List[str], width: int) -> List[str]:
    """A column's values at most ``width`` wide, keeping the part that differs between them.

    A prefix every value shares (a data directory's path) is cut at its last ``/`` and shown as
    ``...``; a value still too long keeps its end, where paths and names differ.
    """
    common = os.path.commonprefix(values) if len(set(values)) > 1 else ""
    cut = common.rfind("/") + 1 if "/" in common else 0
    out = []
    for v in values:
        v = "..." + v[cut:] if cut > 3 and max(map(len, values)) > width else v
        out.append(v if len(v) <= width else "..." + v[-(width - 3):])
    return out


def _metrics_tail(record: RunRecord) -> tuple:
    """(last step, last loss, last in-loop eval loss) of metrics.jsonl; Nones when absent."""
    series = series_of(record.metrics)
    losses = [x for x in series.loss if math.isfinite(x)]
    return (series.steps[-1] if series.steps else None, losses[-1] if losses else None,
            series.eval_loss[-1] if series.eval_loss else None)


def _state(rs: RunStatus, dry_run: bool) -> str:
    """The chain's state: its first job that is not done (the train job's state plain, others named)."""
    by_role = {j.role: j for j in rs.jobs}
    chain = [by_role[role] for role in _CHAIN if role in by_role]
    for job in chain:
        if job.status != "done":
            return job.status if job.role == "train" else f"{job.status} ({job.role})"
    if chain:
        return "done"
    if rs.train_exit is not None:  # a local point: the trainer's own record
        code = rs.train_exit.get("exit_code")
        return "done" if code == 0 else f"failed ({code})"
    return "dry run" if dry_run else "planned"


# How a point's own command ended, when its run directory says no more (sweep.json's exit_code).
_ENDED = {EXIT_USAGE: "refused", EXIT_REQUEUE: "stopped", EXIT_INTERRUPTED: "interrupted", EXIT_TERMINATED: "terminated"}


def _outcome(state: str, exit_code: object, has_jobs: bool) -> str:
    """The point's state, with its command's exit code where that says more.

    A point that never submitted jobs (a local run, or a chain refused at submission) ended
    with its command: a non-zero code there is the outcome, whatever stage failed (planning,
    prepare, training, consolidation), even where no ``train_exit.json`` was written.
    """
    if has_jobs or not isinstance(exit_code, int) or isinstance(exit_code, bool) or exit_code == 0:
        return state
    return f"{_ENDED.get(exit_code, 'failed')} ({exit_code})"


def collect_sweep(sweep_dir: Path) -> List[PointStatus]:
    """Every point of the sweep in ``sweep_dir``, with the best one (lowest eval loss) marked."""
    index = read_sweep_index(sweep_dir)
    points = index["points"]
    out: List[PointStatus] = []
    varied = _varying(points)
    for p, varying, values in zip(points, varied, _columns(varied)[1]):
        run_dir = Path(str(p.get("run_dir")))
        ps = PointStatus(int(p.get("num", len(out))), " ".join(varying) or "(no overrides)", str(run_dir),
                         "planned", jobs=dict(p.get("jobs") or {}), values=values)
        if (run_dir / CONFIG_FILE).is_file():
            record = open_run(run_dir)
            rs = collect(run_dir, record)
            ps.state = _state(rs, dry_run=p.get("exit_code") == 0)
            ps.step, ps.loss, loop_eval = _metrics_tail(record)
            ps.eval_loss = (rs.last_eval or {}).get("loss", loop_eval) if rs.last_eval else loop_eval
            if record.config is not None:  # an unreadable config only loses the "/max" part
                ps.max_steps = record.config.train.max_steps
        ps.state = _outcome(ps.state, p.get("exit_code"), bool(ps.jobs))
        out.append(ps)
    scored = [ps for ps in out if isinstance(ps.eval_loss, (int, float))]
    if scored:
        min(scored, key=lambda ps: ps.eval_loss).best = True
    return out


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def format_sweep(sweep_dir: Path, points: List[PointStatus]) -> str:
    """The sweep as a table: a column per key whose value differs between points, the best marked ``<- best``.

    Each swept key is its own column headed by the key (``optimizer.lr``), so every point's
    value shows whole, however many keys vary (a long value keeps the part that differs).
    """
    keys = list(dict.fromkeys(k for ps in points for k in ps.values))
    cells = {k: _shown([ps.values.get(k, "-") for ps in points], _MAX_CELL) for k in keys}
    if not keys:  # nothing varies (one point without overrides, or an index without them)
        keys, cells = ["point"], {"point": _shown([ps.point for ps in points], _MAX_CELL)}
    widths = {k: max([len(k)] + [len(c) for c in cells[k]]) for k in keys}
    head = "  ".join(f"{k:<{widths[k]}}" for k in keys)
    lines = [f"sweep: {sweep_dir} ({len(points)} point{'s' if len(points) != 1 else ''})",
             f"  {'#':>3}  {head}  {'state':<11} {'step':>11}  {'loss':>8}  {'eval loss':>9}"]
    for i, ps in enumerate(points):
        step = "-" if ps.step is None else f"{ps.step}/{ps.max_steps}" if ps.max_steps else str(ps.step)
        row = "  ".join(f"{cells[k][i]:<{widths[k]}}" for k in keys)
        lines.append(f"  {ps.num:>3}  {row}  {ps.state:<11} {step:>11}  {_num(ps.loss):>8}  "
                     f"{_num(ps.eval_loss):>9}" + ("  <- best" if ps.best else ""))
    lines.append("each point's status:" + "".join(f"\n  {shell(status_argv(ps.run_dir))}" for ps in points[:3])
                 + ("\n  ..." if len(points) > 3 else ""))
    return "\n".join(lines)
