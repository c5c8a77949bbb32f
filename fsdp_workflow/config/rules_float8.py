"""``train.float8``: refused, with the reason, wherever it cannot run.

float8 matmuls need FP8 tensor cores (compute capability 8.9 and up: L4, L40S,
H100, H200) and torchao (the ``float8`` extra). A key that is accepted must change
what runs, so the key is refused at validation (exit 2, nothing written):

* on CPU, always;
* for a local CUDA run, when ``nvidia-smi`` reports a GPU below 8.9, or when
  torchao is not installed here (for Slurm and dry runs a missing torchao is a
  warning: the job's environment decides);
* with a strategy or mesh it is not built for (DeepSpeed, FSDP1, tensor parallelism).

The trainer checks the device and torchao again on every rank
(``fsdp_workflow.train.float8.check_available``), since a Slurm job's GPUs are
only known there. No torch import here: the GPU is asked through ``nvidia-smi``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from typing import List, Optional, Tuple

from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.schema import ClusterKind, Device, WorkflowConfig
from fsdp_workflow.config.strategies import STRATEGIES

MIN_CAPABILITY = (8, 9)
FP8_GPUS = "L4, L40S, H100, H200"
INSTALL = "pip install 'fsdp_workflow[float8]'"
FLOAT8_STRATEGIES = tuple(name for name, spec in STRATEGIES.items() if spec.float8)  # fsdp2, ddp


def local_gpus() -> Optional[List[Tuple[str, Tuple[int, int]]]]:
    """``(name, compute capability)`` of this machine's GPUs from ``nvidia-smi``; None when it cannot say."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.splitlines():
        name, _, cap = line.rpartition(",")
        major, _, minor = cap.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            gpus.append((name.strip(), (int(major), int(minor))))
    return gpus or None


def check_float8(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Refuse ``train.float8=true`` where it cannot run or is not built, naming the reason and the fix."""
    t, s, c = cfg.train, cfg.strategy, cfg.cluster
    if not t.float8:
        return
    if c.device == Device.cpu:
        r.error("train.float8", True,
                f"float8 matmuls need CUDA GPUs with FP8 tensor cores (compute capability >= 8.9: {FP8_GPUS}); "
                "torch has no float8 training matmul on CPU",
                "train.float8=false (or cluster.device=cuda on such GPUs)")
        return
    if s.name not in FLOAT8_STRATEGIES:
        built = " and ".join(name.value for name in FLOAT8_STRATEGIES)
        r.error("train.float8", True, f"float8 is built for strategy={built}, not {s.name.value}",
                f"strategy={FLOAT8_STRATEGIES[0].value}, or train.float8=false")
    if s.tensor_parallel_size > 1:
        r.error("train.float8", True,
                "float8 with tensor parallelism needs torchao's float8 TP styles, which the trainer does not apply",
                "strategy.tensor_parallel_size=1, or train.float8=false")
    local = c.kind == ClusterKind.local and not cfg.dry_run
    if local:
        slow = [(name, cap) for name, cap in (local_gpus() or []) if cap < MIN_CAPABILITY]
        if slow:
            name, cap = slow[0]
            r.error("train.float8", True,
                    f"this machine's {name} has compute capability {cap[0]}.{cap[1]}, below the 8.9 that FP8 "
                    f"tensor cores need ({FP8_GPUS})",
                    "train.float8=false on this GPU")
    if importlib.util.find_spec("torchao") is None:
        where = "here" if local else "in this environment (fine if the job's environment has it)"
        (r.error if local else r.warn)("train.float8", True, f"needs the torchao package, which is not installed {where}",
                                       f"{INSTALL} (or train.float8=false)")
    if not t.compile:
        r.warn("train.float8", True,
               "without torch.compile torchao's float8 casts and scales run as separate kernels, which usually "
               "makes float8 slower than bf16",
               "train.compile=true")


RULES: List[Rule] = [check_float8]
