"""Rank-0 progress bar and ``RUN_DIR/metrics.jsonl``.

Each optimizer step appends one JSON line with at least ``step``, ``loss``,
``lr``, ``tokens_per_s`` and ``mfu`` (model FLOPs utilisation, a fraction of
``peak_tflops``, which is also written so the denominator is never a guess).
A resumed run appends to the same file; a step that was redone after a crash
appears twice, and readers take its last line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

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
    """Training FLOPs per token: 6 per non-embedding parameter plus causal attention (PaLM appendix B)."""
    return 6.0 * (num_params - embedding_params) + 6.0 * num_layers * hidden * seq_len


class MetricsLogger:
    """Writes metrics on rank 0; a no-op elsewhere.

    Args:
        path: ``RunDir.metrics`` (appended to: a resumed run continues the file).
        enabled: True on rank 0.
        total_steps: ``train.max_steps`` (for the progress bar).
        initial_step: the step training resumes from.
        log_every_steps: how often to print a line under the bar.
    """

    def __init__(self, path: Path, enabled: bool, total_steps: int, initial_step: int, log_every_steps: int):
        self.enabled = enabled
        self.log_every = max(1, log_every_steps)
        self.path = Path(path)
        self._bar: Any = None
        self._fh: Any = None
        if enabled:
            from tqdm import tqdm

            self._fh = open(self.path, "a", encoding="utf-8")
            self._bar = tqdm(total=total_steps, initial=initial_step, file=sys.stderr, desc="train",
                             dynamic_ncols=True, mininterval=1.0)

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must carry ``step``) and advance the bar."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if "loss" in record and "tokens_per_s" in record:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                  tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            if record["step"] % self.log_every == 0:
                self.write(
                    f"step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.3e} "
                    f"tokens/s {record['tokens_per_s']:.0f} mfu {100 * record['mfu']:.1f}%"
                )

    def write(self, message: str) -> None:
        """Print a line on rank 0 without breaking the bar."""
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        if self.enabled:
            self._bar.close()
            self._fh.close()
