"""Rank-0 ``RUN_DIR/metrics.jsonl``, progress, and the hook that feeds the experiment trackers.

Each optimizer step appends one JSON line with at least ``step``, ``loss``,
``lr``, ``tokens_per_s`` and ``mfu`` (model FLOPs utilisation, a fraction of
``peak_tflops``, which is also written so the denominator is never a guess).
Each step is recorded once, whatever the crashes and resumes: a run that starts
at step N (resumed from ``step-N``, or 0 for a fresh start) first rewrites the
file atomically to the lines of steps up to N (:func:`keep_steps_up_to`), then
appends. The steps a killed run logged past its last checkpoint are redone, and
only the redone lines remain. Each line also goes to the ``on_record`` callback
(the trackers of ``train.report_to``: :mod:`.trackers`).

Progress: on a terminal, a bar with a ``step N/M`` line logged every
``train.log_every_steps``; in a log file (a Slurm job), only those lines.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from fsdp_workflow.core.logs import close_bar, progress_bar
from fsdp_workflow.core.rundir import atomic_write_text

log = logging.getLogger(__name__)

# Dense bf16 peak per device, TFLOP/s (no sparsity), by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10": 125.0}
# CPUs have no meaningful "peak" here: a nominal figure per process so mfu stays a
# number; set train.peak_tflops for a real one.
CPU_NOMINAL_TFLOPS = 1.0


def guess_peak_tflops(device_type: str, configured: Optional[float]) -> float:
    """Peak TFLOP/s of one device: the configured value, a table lookup, or the CPU nominal."""
    if configured:
        return float(configured)
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
        return 989.0
    return CPU_NOMINAL_TFLOPS


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int, embedding_params: int = 0) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter plus causal attention (PaLM appendix B).

    For a mixture of experts ``num_params`` is the *active* count (:func:`active_parameters`):
    a token runs through ``top_k`` experts, not all of them.
    """
    return 6.0 * (num_params - embedding_params) + 6.0 * num_layers * hidden * seq_len


def active_parameters(numels: Iterable[tuple[str, int]], num_experts: Optional[int], top_k: Optional[int]) -> int:
    """Parameters one token runs through: routed experts count ``top_k / num_experts`` of their size.

    Args:
        numels: ``(name, numel)`` of every parameter, each once (global sizes, not shards).
        num_experts: experts per MoE layer (HF ``num_experts`` / ``num_local_experts``); None: dense.
        top_k: experts each token is routed to (``num_experts_per_tok``).

    Returns:
        The count; for a dense model, all of them.

    A routed expert's weights are those under a module named ``experts`` (transformers
    stores each layer's experts as 3-D ``experts.gate_up_proj``/``down_proj``); a shared
    expert (``shared_expert``) and the router run for every token and count whole.
    """
    total = 0
    for name, numel in numels:
        routed = num_experts and top_k and "experts" in name.split(".")
        total += numel * top_k // num_experts if routed else numel
    return total


class MetricsLogger:
    """Writes metrics on rank 0; a no-op elsewhere.

    Args:
        path: ``RunDir.metrics`` (appended to: a resumed run continues the file).
        enabled: True on rank 0.
        total_steps: ``train.max_steps`` (for the progress line and bar).
        initial_step: the step training resumes from.
        log_every_steps: how often to log a progress line.
        on_record: called with every line written (the experiment trackers), on rank 0.
    """

    def __init__(self, path: Path, enabled: bool, total_steps: int, initial_step: int, log_every_steps: int,
                 on_record: Optional[Callable[[Mapping[str, Any]], None]] = None):
        self.enabled = enabled
        self.log_every = max(1, log_every_steps)
        self.total_steps = total_steps
        self.path = Path(path)
        self.on_record = on_record
        self._bar: Any = None
        self._fh: Any = None
        if enabled:
            keep_steps_up_to(self.path, initial_step)
            self._fh = open(self.path, "a", encoding="utf-8")
            self._bar = progress_bar(total_steps, initial_step, desc="train")  # None when not a terminal

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must carry ``step``), pass it to ``on_record``, advance the progress."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self.on_record is not None:
            self.on_record(record)
        if "loss" in record and "tokens_per_s" in record:
            if self._bar is not None:
                self._bar.update(1)
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                      tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            if record["step"] % self.log_every == 0 or record["step"] == self.total_steps:
                log.info(progress_line(record, self.total_steps))

    def write(self, message: str) -> None:
        """Log a line on rank 0 (above the bar, on a terminal)."""
        if self.enabled:
            log.info(message)

    def close(self) -> None:
        if self.enabled:
            close_bar(self._bar)
            self._fh.close()


def keep_steps_up_to(path: Path, step: int) -> int:
    """Rewrite ``path`` (atomically) to its lines of steps ``<= step``; return how many lines were dropped.

    Lines past ``step`` were logged by an attempt that died after its last
    checkpoint; the resumed run logs those steps again. A torn line (a kill in
    the middle of a write) is dropped too. Nothing is rewritten when nothing
    would be dropped.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        s = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(s, int) and not isinstance(s, bool) and s <= step:
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        atomic_write_text(Path(path), "".join(f"{line}\n" for line in kept))
        log.info("metrics.jsonl: dropped %d line(s) past step %d, logged before the run was resumed from it",
                 dropped, step)
    return dropped


def progress_line(record: Mapping[str, Any], total_steps: int) -> str:
    """``step 10/100 (10%): loss 2.3456 lr 1.000e-04 tokens/s 1234 mfu 12.3%`` (plus eval loss when measured)."""
    step = int(record["step"])
    line = (f"step {step}/{total_steps} ({100 * step / max(total_steps, 1):.0f}%): loss {record['loss']:.4f} "
            f"lr {record['lr']:.3e} tokens/s {record['tokens_per_s']:.0f} mfu {100 * record['mfu']:.1f}%")
    if "eval_loss" in record:
        line += f" eval_loss {record['eval_loss']:.4f}"
    return line
