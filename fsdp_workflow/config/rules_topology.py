"""Launch topology rules: world size, devices, batch arithmetic, Slurm.

A world size that disagrees with the GPUs asked for, or a global batch that
is not what the arithmetic gives, fails only after the job waited in the
queue; these rules catch it on the login node.
"""

from __future__ import annotations

import math

from typing import List, Optional

from fsdp_workflow.config.schema import (
    ClusterKind,
    Device,
    Launcher,
    MixedPrecision,
    RankStart,
    WorkflowConfig,
    data_parallel_size,
    world_size,
)
from fsdp_workflow.config.errors import Rule, ValidationReport
from fsdp_workflow.config.strategies import is_deepspeed, is_fsdp, spec_of


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
            "train.mixed_precision=bf16 (or train.mixed_precision=no) on a CPU host",
        )
    if c.device == Device.cpu and is_deepspeed(cfg.strategy.name):
        r.error(
            "strategy.name", cfg.strategy.name,
            "DeepSpeed needs GPUs: with device=cpu Accelerate ignores ACCELERATE_USE_DEEPSPEED",
            "strategy=fsdp2 for CPU runs (or cluster.device=cuda)",
        )


def check_cluster(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Multi-node runs need Slurm; Slurm needs a partition; a preloaded start needs torchrun's agent."""
    c = cfg.cluster
    if c.rank_start == RankStart.preloaded and c.launcher != Launcher.torchrun:
        r.error(
            "cluster.rank_start", c.rank_start.value,
            f"the ranks are forked by torchrun's agent (python -m fsdp_workflow.train.node); "
            f"cluster.launcher={c.launcher.value} starts them itself",
            "cluster.rank_start=auto (or exec), or cluster.launcher=torchrun",
        )
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
            "cluster.launcher=torchrun (keeps FSDP with one process), or cluster.processes_per_node=2 or more",
        )
    else:
        r.warn(
            "cluster.processes_per_node", 1,
            "FSDP with world size 1 runs (torchrun keeps DistributedType.FSDP) but shards "
            "nothing: memory is the same as without FSDP",
            "fine for debugging; for savings use cluster.processes_per_node=N>1",
        )


def check_parallel_dims(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The device mesh (dp_replicate x dp_shard x cp x tp) must tile the world and suit the model.

    TP within a node is an error, not a warning: a TP group all-reduces the
    activations of every layer twice in forward and twice in backward, which over
    the inter-node network costs more than the memory it saves, and the mesh puts
    TP innermost precisely so that a TP group is consecutive ranks on one node.
    """
    s, m, c = cfg.strategy, cfg.model, cfg.cluster
    rep, tp, cp, world = s.dp_replicate_size, s.tensor_parallel_size, s.context_parallel_size, world_size(cfg)
    if min(rep, tp, cp, world) < 1:
        return  # reported by check_counts
    sizes = {"strategy.dp_replicate_size": rep, "strategy.tensor_parallel_size": tp,
             "strategy.context_parallel_size": cp}
    above = [k for k, v in sizes.items() if v > 1]
    if above and not spec_of(cfg).builds_mesh:
        for key in above:
            r.error(
                key, sizes[key],
                f"the device mesh (hybrid sharding, tensor and context parallelism) is built for FSDP2 only, "
                f"not {s.name.value}",
                f"strategy=fsdp2 (or {key}=1)",
            )
    if world % (rep * tp * cp):
        key = above[-1] if above else "strategy.tensor_parallel_size"
        r.error(
            key, sizes[key],
            f"dp_replicate_size {rep} x context_parallel_size {cp} x tensor_parallel_size {tp} = {rep * cp * tp} "
            f"does not divide the world size {world} (= cluster.nodes {c.nodes} x cluster.processes_per_node "
            f"{c.processes_per_node}); dp_shard is what is left and must be a whole number",
            f"sizes whose product divides {world}",
        )
    if tp > 1:
        if m.num_attention_heads % tp or m.num_key_value_heads % tp:
            r.error(
                "strategy.tensor_parallel_size", tp,
                f"attention heads ({m.num_attention_heads}) and KV heads ({m.num_key_value_heads}) "
                "must both split evenly across tensor-parallel ranks",
                "a tensor_parallel_size that divides both head counts",
            )
        if c.processes_per_node % tp:
            r.error(
                "strategy.tensor_parallel_size", tp,
                f"a tensor-parallel group would span nodes ({c.processes_per_node} processes per node): TP "
                "all-reduces every layer's activations, which the inter-node network makes slower than "
                "the memory it saves",
                f"strategy.tensor_parallel_size={math.gcd(tp, c.processes_per_node)} (a size dividing the "
                f"{c.processes_per_node} processes per node; shard across nodes with FSDP instead)",
            )
    if rep > 1 and tp > 1 and world == rep * tp:  # with cp FSDP2 shards over dp_shard x cp: sharded anyway
        r.error(
            "strategy.dp_replicate_size", rep,
            f"tensor parallelism with replicas but no sharding (dp_shard = {world} / "
            f"({rep} x {tp}) = 1) is not built here, as in Accelerate's ParallelismConfig",
            "strategy.dp_replicate_size=1 (FSDP + TP), or more ranks so that dp_shard > 1 (HSDP + TP)",
        )
    if rep > 1 and world % (rep * tp * cp) == 0 and c.nodes % rep and rep % c.nodes:
        r.warn(
            "strategy.dp_replicate_size", rep,
            f"{rep} replicas over {c.nodes} nodes: a replica's shards straddle node boundaries, so "
            "the sharded all-gathers cross the network anyway",
            f"strategy.dp_replicate_size={c.nodes} (replicate across nodes, shard within)",
        )
    if cp > 1:
        check_context_parallel(cfg, r)


def kv_replication(num_heads: int, num_kv_heads: int, cp: int) -> Optional[int]:
    """How many times Ulysses repeats each KV head before splitting the heads over ``cp`` ranks (1: none).

    Returns:
        ``r`` with ``num_kv_heads x r`` divisible by ``cp`` and ``r`` dividing the query heads per
        KV head (a rank's query heads then find their KV heads on the same rank); None when
        ``cp`` does not divide the query heads (when it does, such an ``r`` always exists:
        ``cp | kv x g`` gives ``cp / gcd(kv, cp) | g``).
    """
    if min(num_heads, num_kv_heads, cp) < 1 or num_heads % cp or num_heads % num_kv_heads:
        return None
    r = cp // math.gcd(num_kv_heads, cp)
    return r if (num_heads // num_kv_heads) % r == 0 else None


def check_context_parallel(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Ulysses (``context_parallel_size > 1``): heads and positions must split over cp (docs/parallelism.md).

    Each cp rank holds ``seq_len / cp`` positions outside attention and the whole sequence
    for ``heads / (tp x cp)`` query heads inside it; KV heads split too, or are repeated
    first when there are fewer than cp (per TP rank) of them (:func:`kv_replication`).
    """
    s, m, t = cfg.strategy, cfg.model, cfg.train
    cp, tp = s.context_parallel_size, s.tensor_parallel_size
    if t.seq_len % cp:
        r.error("train.seq_len", t.seq_len, f"Ulysses gives each of the {cp} context-parallel ranks an equal "
                "slice of every sequence", f"a train.seq_len divisible by {cp}")
    heads, kv = m.num_attention_heads, m.num_key_value_heads
    if tp > 1 and (heads % tp or kv % tp):
        return  # reported by the tensor-parallel rule
    local, local_kv = heads // tp, kv // tp
    per = f" per tensor-parallel rank (tp {tp})" if tp > 1 else ""
    if kv_replication(local, local_kv, cp) is None:
        fits = [n for n in range(2, local + 1) if kv_replication(local, local_kv, n) is not None]
        r.error("strategy.context_parallel_size", cp,
                f"the {local} query heads{per} must split evenly over the {cp} context-parallel ranks (the "
                f"{local_kv} KV heads{per} are split too, or repeated cp / gcd(KV heads, cp) times when fewer)",
                f"strategy.context_parallel_size in {fits}" if fits else "strategy.context_parallel_size=1")
    from fsdp_workflow.config.model_dir import effective_config, family_of

    fam = family_of(m)
    softcap = effective_config(m).get("attn_logit_softcapping")
    if fam.read_from not in ("unknown", "table") and "sdpa" not in fam.attention:
        # gpt_oss (attention sinks), Gemma 2: advising sdpa would name a value the family refuses (issue 49)
        capped = f"; it soft-caps its attention scores (attn_logit_softcapping={softcap})" if softcap is not None else ""
        r.error("strategy.context_parallel_size", cp,
                f"Ulysses context parallelism runs attention through PyTorch SDPA, and {fam.causal_lm} does not "
                f"support SDPA (transformers accepts {', '.join(fam.attention)} for it{capped}): its sequences "
                "cannot be split over context-parallel ranks",
                "strategy.context_parallel_size=1 (strategy.activation_checkpointing=full for long sequences)")
        return
    if m.attn_implementation != "sdpa":
        r.error("model.attn_implementation", m.attn_implementation,
                "with strategy.context_parallel_size > 1 attention runs through the Ulysses all-to-all around "
                "PyTorch SDPA, so this attention implementation would not be used",
                "model.attn_implementation=sdpa")
    if softcap is not None:
        r.error("strategy.context_parallel_size", cp, f"the model soft-caps its attention scores "
                f"(attn_logit_softcapping={softcap}), which SDPA, inside the Ulysses attention, cannot do",
                "strategy.context_parallel_size=1 (strategy.activation_checkpointing=full for long sequences)")


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


RULES: List[Rule] = [
    check_devices,
    check_cluster,
    check_single_process_fsdp,
    check_parallel_dims,
    check_batch,
]  # train.seq_len against the model's positions: rules_model.check_positions
