"""Rules about what the run will meet: packages, Slurm tokens, job sizes, unbuilt features.

These used to surface one at a time: a ``#SBATCH`` token while rendering, a
missing torchao when training started, an evaluation job killed for memory
after the first checkpoint. Here they join the one report, before anything is
written or submitted. No torch import: packages are looked up, not imported.
"""

from __future__ import annotations

import importlib.util
import math
import re
from typing import List, Optional, Tuple

from fsdp_workflow.config.model_size import num_params
from fsdp_workflow.config.schema import (
    ClusterKind,
    ContextParallelImpl,
    DataSource,
    Device,
    Launcher,
    OptimizerName,
    SchedulerName,
    WorkflowConfig,
)
from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.strategies import is_deepspeed

# #SBATCH values are not parsed by a shell: keep them to one safe token. The
# planner asserts the same pattern when it renders (fsdp_workflow.plan.spec).
SAFE_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:+\-=@%/&|*()\[\]!]+$")

# Optional packages a choice needs: (module, pip name, what needs it).
_OPTIMIZER_PACKAGES = {
    OptimizerName.adamw_torch_8bit: ("torchao", "torchao"),
    OptimizerName.adamw_8bit: ("bitsandbytes", "bitsandbytes"),
    OptimizerName.adamw_bnb_8bit: ("bitsandbytes", "bitsandbytes"),
}
_DATA_PACKAGES = {
    DataSource.parquet: ("pyarrow", "fsdp_workflow[data]"),
    DataSource.hf_disk: ("datasets", "fsdp_workflow[data]"),
}


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def check_not_implemented(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Keys kept for the schema's shape whose non-default values are not built.

    ``strategy.context_parallel_impl=ring``, torch's ring-attention context parallel:
    torch 2.13's ``context_parallel`` has no sharding rule for the CPU attention kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``; the math kernel mixes DTensors
    and tensors), measured with gloo; and on GPUs it shards only ``is_causal`` SDPA
    without a mask, while the trainer keeps packed documents apart through position ids
    (a block-diagonal mask), so documents would attend across their boundaries. Refused
    on every device until built; ``ulysses`` (the default) is built.
    """
    impl = cfg.strategy.context_parallel_impl
    if impl == ContextParallelImpl.ring:
        why = ("torch 2.13's ring context parallel cannot run on CPU: no sharding rule for the CPU SDPA kernel "
               "(aten._scaled_dot_product_flash_attention_for_cpu)" if cfg.cluster.device == Device.cpu else
               "not implemented: torch's ring context parallel shards only causal SDPA without a mask, and the "
               "trainer's packed documents need their block-diagonal mask (attention would cross documents)")
        r.error("strategy.context_parallel_impl", impl.value, why,
                "strategy.context_parallel_impl=ulysses (the all-to-all sequence parallelism, built and tested)")


def check_packages(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Optional packages the chosen optimizer, data source or strategy needs.

    An error for a real local run (this environment is the one that trains); a
    warning for Slurm and dry runs, where the job's environment decides.
    """
    needs: List[Tuple[str, str, str, object]] = []
    if cfg.optimizer.name in _OPTIMIZER_PACKAGES:
        mod, pip = _OPTIMIZER_PACKAGES[cfg.optimizer.name]
        needs.append(("optimizer.name", mod, pip, cfg.optimizer.name))
    if cfg.data.source in _DATA_PACKAGES:
        mod, pip = _DATA_PACKAGES[cfg.data.source]
        needs.append(("data.source", mod, pip, cfg.data.source))
    if cfg.strategy.name.value.startswith("deepspeed"):
        needs.append(("strategy.name", "deepspeed", "fsdp_workflow[deepspeed]", cfg.strategy.name))
    local = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
    for key, mod, pip, value in needs:
        if not _missing(mod):
            continue
        where = "here" if local else "in this environment (fine if the job's environment has it)"
        (r.error if local else r.warn)(
            key, value, f"needs the {mod} package, which is not installed {where}",
            f"pip install {pip} (or choose another {key.split('.')[1]})",
        )


def _sbatch_values(cfg: WorkflowConfig) -> List[Tuple[str, Optional[str]]]:
    c = cfg.cluster
    values: List[Tuple[str, Optional[str]]] = [
        ("name", cfg.name), ("cluster.partition", c.partition), ("cluster.account", c.account),
        ("cluster.qos", c.qos), ("cluster.constraint", c.constraint),
        ("cluster.consolidate_partition", c.consolidate_partition),
    ]
    for key, value in c.additional_parameters.items():
        values += [("cluster.additional_parameters", str(key)), (f"cluster.additional_parameters.{key}", str(value))]
    return values


def check_sbatch_tokens(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Every value that lands on an ``#SBATCH`` line is one safe token (scripts are rendered for every run)."""
    for key, value in _sbatch_values(cfg):
        if value is not None and value != "" and not SAFE_SBATCH_VALUE.match(value):
            r.error(key, value,
                    "#SBATCH values must be one token: letters, digits and _.,:+-=@%/&|*()[]! only "
                    "(no spaces, quotes, # or newlines)",
                    f"{key}=<one token>, or pass a complex option through cluster.additional_parameters")


def eval_job_mem_gb(cfg: WorkflowConfig) -> int:
    """Memory the per-checkpoint evaluation job needs: the model in bf16, plus activations and the interpreter."""
    weights_gb = num_params(cfg.model) * 2 / 1e9
    return int(math.ceil(weights_gb * 1.25 + 2))


def check_job_resources(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The CPU jobs' resources against the model's size.

    Consolidation streams tensor by tensor (tens of MB whatever the model), so
    only the evaluation job, which loads the whole model in bf16, is sized here.
    """
    c, cs = cfg.cluster, cfg.consolidate
    if not (cs.every_checkpoint and c.kind == ClusterKind.slurm):
        return
    need = eval_job_mem_gb(cfg)
    if c.consolidate_mem_gb < need:
        r.error("cluster.consolidate_mem_gb", c.consolidate_mem_gb,
                f"consolidate.every_checkpoint runs an evaluation job that loads {cfg.model.name} "
                f"({num_params(cfg.model) / 1e9:.3g} B parameters) in bf16 with these resources: "
                f"it needs about {need} GB",
                f"cluster.consolidate_mem_gb={need} (or consolidate.every_checkpoint=false)")


def check_ignored_combinations(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Values that would be accepted and then have no effect, or a launcher that cannot honour them."""
    o, c = cfg.optimizer, cfg.cluster
    if o.scheduler == SchedulerName.constant and o.min_lr_ratio != 0:
        r.error("optimizer.min_lr_ratio", o.min_lr_ratio,
                "a constant schedule never decays, so the floor would be ignored",
                "optimizer.min_lr_ratio=0 (or optimizer.scheduler=cosine / linear)")
    if c.launcher == Launcher.accelerate and c.device == Device.cpu:
        r.error("cluster.launcher", "accelerate",
                "on CPU `accelerate launch` uses a launcher that cannot start the gloo process group "
                "FSDP2 needs, and it forwards no preemption signal",
                "cluster.launcher=torchrun")
    if c.launcher == Launcher.accelerate and c.nodes > 1 and is_deepspeed(cfg.strategy.name):
        r.error("cluster.launcher", "accelerate",
                "multi-node DeepSpeed under `accelerate launch` starts its own pdsh runner, which does not fit "
                "the one-launcher-per-node Slurm step and forwards no signal",
                "cluster.launcher=torchrun")


RULES: List[Rule] = [check_not_implemented, check_packages, check_sbatch_tokens, check_job_resources,
                     check_ignored_combinations]
