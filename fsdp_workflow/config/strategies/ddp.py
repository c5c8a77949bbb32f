"""Plain data parallelism: every rank holds the whole model and optimizer (Accelerate's DDP)."""

from __future__ import annotations

from typing import Dict, Tuple

from fsdp_workflow.config.strategies.base import StrategySpec

ORDER = 2  # StrategyName: fsdp2, fsdp1, ddp, deepspeed_zero1-3


def memory(p: float, opt: float, low: int, mesh: Dict[str, int], world: int) -> Tuple[float, float, float]:
    """Everything replicated: fp32 params and grads, the whole optimizer state."""
    return 4 * p, 4 * p, opt


SPECS = (
    StrategySpec(
        name="ddp",
        memory=memory,
        held="each holds the whole model (DDP replicas)",
        ema=None,
        float8=True,
    ),
)
