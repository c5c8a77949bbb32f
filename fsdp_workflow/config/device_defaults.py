"""Defaults that depend on where the run trains, settled at planning and recorded.

``train.compile: null`` (the default) becomes ``true`` where the compiled path is
the measured fast path, and ``false`` elsewhere, before the rules run and
config.yaml is written: what the record says is what ran, and a rerun of the same
command settles the same way.

Why compile by default on CUDA: on one H100 (docs/training.md, "Against
torchtitan") eager ran at 0.83x torchtitan's tokens/s and compiled at 1.01x, with
28% less memory. Why only FSDP2 without tensor or context parallelism: that is the
path measured on a GPU; the others may compile (``train.compile=true``) but are
not turned on behind the user's back. CPU runs stay eager: compiling costs more
than it saves at the sizes a CPU trains.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.schema import Device, WorkflowConfig
from fsdp_workflow.config.strategies import spec_of

__all__ = ["settle_compile"]


def settle_compile(cfg: WorkflowConfig) -> List[str]:
    """Give ``train.compile`` its value when it is null; returns the note for the plan's summary (or none)."""
    t, s = cfg.train, cfg.strategy
    if t.compile is not None:
        return []
    cuda = cfg.cluster.device == Device.cuda
    spec = spec_of(cfg)
    measured = spec.compile_measured and s.tensor_parallel_size == 1 and s.context_parallel_size == 1
    t.compile = cuda and measured
    if t.compile:
        return ["train.compile: null -> true (FSDP2 on CUDA: the compiled path, 1.01x torchtitan's tokens/s on "
                "one H100 against eager's 0.83x, docs/training.md); train.compile=false trains eager"]
    if cuda:
        why = (f"strategy.name={s.name.value}" if not spec.compile_measured else
               "tensor parallelism" if s.tensor_parallel_size > 1 else "context parallelism")
        return [f"train.compile: null -> false ({why}: compile is on by default only where it was measured, "
                "FSDP2 without tp or cp); train.compile=true compiles anyway"]
    return []
