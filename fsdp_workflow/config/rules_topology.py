"""Launch topology rules: world size, devices, batch arithmetic, Slurm.

A world size that disagrees with the GPUs asked for, or a global batch that
is not what the arithmetic gives, fails only after the job waited in the
queue; these rules catch it on the login node.
"""

from __future__ import annotations

from typing import List

from fsdp_workflow.config.accelerate_env import is_deepspeed, is_fsdp
from fsdp_workflow.config.schema import (
    ClusterKind,
    Device,
    Launcher,
    MixedPrecision,
    WorkflowConfig,
    data_parallel_size,
    world_size,
)
from fsdp_workflow.config.errors import Rule, ValidationReport


def check_devices(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Processes per node against GPUs per node, and CPU-only combinations."""
    c = cfg.cluster
    if c.device == Device.cuda and c.gpus_per_node is not None:
        if c.gpus_per_node < 1:
            r.error(
                "cluster.gpus_per_node", c.gpus_per_node,
                "device=cuda needs at least one GPU per node",
                f"cluster.gpus_per_node={c.processes_per_node} (or cluster.device=cpu)",
            )
        elif c.processes_per_node > c.gpus_per_node:
            r.error(
                "cluster.processes_per_node", c.processes_per_node,
                f"{c.processes_per_node} ranks per node but only {c.gpus_per_node} GPUs: "
                "ranks would share a GPU, which NCCL refuses",
                f"cluster.processes_per_node={c.gpus_per_node}",
            )
        elif c.processes_per_node < c.gpus_per_node:
            r.warn(
                "cluster.processes_per_node", c.processes_per_node,
                f"{c.gpus_per_node - c.processes_per_node} of the {c.gpus_per_node} GPUs "
                "asked for per node would sit idle",
                f"cluster.processes_per_node={c.gpus_per_node}",
            )
    if c.device == Device.cpu and c.gpus_per_node:
        r.warn(
            "cluster.gpus_per_node", c.gpus_per_node,
            "device=cpu never uses the GPUs this requests from Slurm",
            "cluster.gpus_per_node=0 (or cluster.device=cuda)",
        )
    if c.device == Device.cpu and cfg.train.mixed_precision == MixedPrecision.fp16:
        r.error(
            "train.mixed_precision", "fp16",
            "Accelerate refuses fp16 mixed precision on CPU (it needs a GPU and a grad scaler)",
            "train.mixed_precision=bf16 (or no) for device=cpu",
        )
    if c.device == Device.cpu and is_deepspeed(cfg.strategy.name):
        r.error(
            "strategy.name", cfg.strategy.name,
            "DeepSpeed needs GPUs: with device=cpu Accelerate ignores ACCELERATE_USE_DEEPSPEED",
            "strategy=fsdp2 for CPU runs (or cluster.device=cuda)",
        )


def check_cluster(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Multi-node runs need Slurm; Slurm needs a partition."""
    c = cfg.cluster
    if c.nodes > 1 and c.kind != ClusterKind.slurm:
        r.error(
            "cluster.nodes", c.nodes,
            f"{c.nodes} nodes need a scheduler to start one launcher per node; cluster.kind=local runs on this machine only",
            "cluster=slurm cluster.partition=NAME (or cluster.nodes=1)",
        )
    if c.kind == ClusterKind.slurm and not c.partition:
        r.error(
            "cluster.partition", c.partition,
            "Slurm needs a partition to queue the training job in",
            "cluster.partition=NAME (`sinfo -s` lists them)",
        )
    if c.kind == ClusterKind.slurm and 0 < c.time_min * 60 <= c.signal_delay_s:
        r.error(
            "cluster.signal_delay_s", c.signal_delay_s,
            f"the pre-timeout signal would come before the job starts (time limit {c.time_min} min)",
            f"cluster.signal_delay_s={min(300, c.time_min * 60 // 4)}",
        )


def check_single_process_fsdp(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """FSDP with one rank: harmless under torchrun, dropped by Accelerate's launcher."""
    if not is_fsdp(cfg.strategy.name) or world_size(cfg) != 1:
        return
    if cfg.cluster.launcher == Launcher.accelerate:
        r.error(
            "cluster.launcher", "accelerate",
            "with one process, `accelerate launch` starts a plain single-process run "
            "(DistributedType.NO) and drops FSDP without a word (seen on an H100)",
            "cluster.launcher=torchrun (keeps FSDP with one process), or cluster.processes_per_node=2+",
        )
    else:
        r.warn(
            "cluster.processes_per_node", 1,
            "FSDP with world size 1 runs (torchrun keeps DistributedType.FSDP) but shards "
            "nothing: memory is the same as without FSDP",
            "fine for debugging; for savings use cluster.processes_per_node=N>1",
        )


def check_parallel_dims(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Tensor / context parallel sizes must divide the world and suit the model."""
    s, m = cfg.strategy, cfg.model
    tp, cp, world = s.tensor_parallel_size, s.context_parallel_size, world_size(cfg)
    if tp < 1 or cp < 1 or world < 1:
        return  # reported by check_counts
    if tp > 1 or cp > 1:
        if s.name.value != "fsdp2":
            key = "strategy.tensor_parallel_size" if tp > 1 else "strategy.context_parallel_size"
            r.error(
                key, tp if tp > 1 else cp,
                f"tensor/context parallelism goes through Accelerate's ParallelismConfig, which needs FSDP2, not {s.name.value}",
                f"strategy=fsdp2 (or {key}=1)",
            )
    if world % (tp * cp):
        key = "strategy.tensor_parallel_size" if tp > 1 else "strategy.context_parallel_size"
        r.error(
            key, tp if tp > 1 else cp,
            f"tensor_parallel_size x context_parallel_size = {tp * cp} does not divide the world size "
            f"{world} (= cluster.nodes {cfg.cluster.nodes} x cluster.processes_per_node {cfg.cluster.processes_per_node})",
            f"pick sizes whose product divides {world}",
        )
    if tp > 1:
        if m.num_attention_heads % tp or m.num_key_value_heads % tp:
            r.error(
                "strategy.tensor_parallel_size", tp,
                f"attention heads ({m.num_attention_heads}) and KV heads ({m.num_key_value_heads}) "
                "must both split evenly across tensor-parallel ranks",
                "a tensor_parallel_size that divides both head counts",
            )
        if tp > cfg.cluster.processes_per_node:
            r.warn(
                "strategy.tensor_parallel_size", tp,
                "tensor parallelism across nodes communicates every layer over the network",
                f"strategy.tensor_parallel_size<={cfg.cluster.processes_per_node}",
            )
    if cp > 1 and cfg.train.seq_len % (2 * cp):
        r.error(
            "train.seq_len", cfg.train.seq_len,
            f"context parallelism splits each sequence into 2 x {cp} load-balanced chunks",
            f"a train.seq_len divisible by {2 * cp}",
        )


def check_batch(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """global_batch_size = micro_batch_size x grad_accum_steps x data-parallel size."""
    t = cfg.train
    if t.global_batch_size is None or min(t.micro_batch_size, t.grad_accum_steps) < 1:
        return
    dp = data_parallel_size(cfg)
    got = t.micro_batch_size * t.grad_accum_steps * dp
    if t.global_batch_size == got:
        return
    per_step = t.micro_batch_size * dp
    if t.global_batch_size > 0 and t.global_batch_size % per_step == 0:
        fix = f"train.grad_accum_steps={t.global_batch_size // per_step} (or train.global_batch_size={got})"
    else:
        fix = f"train.global_batch_size={got}, or micro_batch_size/grad_accum_steps whose product x {dp} is the target"
    r.error(
        "train.global_batch_size", t.global_batch_size,
        f"micro_batch_size {t.micro_batch_size} x grad_accum_steps {t.grad_accum_steps} x "
        f"data-parallel size {dp} = {got} sequences per step",
        fix,
    )


def check_sequence(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Packed sequences must fit the model's positions."""
    t, m = cfg.train, cfg.model
    if t.seq_len > m.max_position_embeddings:
        r.error(
            "train.seq_len", t.seq_len,
            f"longer than model.max_position_embeddings ({m.max_position_embeddings}) of {m.name}",
            f"train.seq_len={m.max_position_embeddings} (or less)",
        )


RULES: List[Rule] = [
    check_devices,
    check_cluster,
    check_single_process_fsdp,
    check_parallel_dims,
    check_batch,
    check_sequence,
]
