"""Batch arithmetic and a per-GPU memory estimate, from the config alone.

The estimate is deliberately simple (parameter count from the shape fields,
bytes per parameter by sharding scheme, activations per token and layer) so that
a planner on a login node can say "this will not fit" before hours in the queue.
It is an estimate: the summary says so. It is held against measured peaks
(``max_memory_allocated``) by tests/plan/test_memory_estimate.py: within -5% ..
+10% of each run of tests/plan/fixtures/measured_peaks.csv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from fsdp_workflow.config.schema import (
    ActivationCheckpointing,
    Device,
    MixedPrecision,
    ModelConfig,
    ModelInit,
    OptimizerName,
    WorkflowConfig,
    data_parallel_size,
    mesh_shape,
    world_size,
)
from fsdp_workflow.config.model_dir import effective_config, experts
from fsdp_workflow.config.strategies import spec_of
from fsdp_workflow.config.rules_topology import kv_replication
from fsdp_workflow.config.model_size import count_params, num_params
from fsdp_workflow.data.summary import summary_lines as data_summary_lines

GIB = 1024**3


def _optimizer_bytes(name: OptimizerName) -> float:
    if name in (OptimizerName.adamw_8bit, OptimizerName.adamw_bnb_8bit, OptimizerName.adamw_torch_8bit):
        return 2.0
    if name == OptimizerName.sgd:
        return 4.0
    return 8.0  # two fp32 moments


# The chunk of positions train/loss.py's chunked loss runs lm_head and the cross-entropy over
# (install_chunked_loss_forward's chunk_tokens; tests/plan/test_memory_estimate.py holds them equal).
LOSS_CHUNK_TOKENS = 8192

# Saved activations of one decoder layer per token, in units of hidden_size values of the compute
# dtype. Calibrated on the runs of tests/plan/fixtures/measured_peaks.csv (one H100, Llama-3.2-1B's
# shape); an element count of a Llama layer gives about 17 compiled (input, q/k/v after rotary,
# attention output, residual, gate, up and their product, inductor recomputing the norms) and about
# 30 eager (rotary and RMSNorm's fp32 intermediates, the SiLU output besides).
LAYER_ACTS_COMPILED = 16.0
LAYER_ACTS_EAGER = 24.0
# float8 (train.float8) saves the inputs of a layer's linears as float8, one byte instead of two: the
# two norm outputs, the attention output and the MLP's product, 7 units of which half is saved.
FLOAT8_SAVING = 3.5


@dataclass
class MemoryEstimate:
    """Per-rank GiB. The peak comes in backward: the gradients grow as the activations are freed, so
    the total holds the larger of the two sides, not their sum."""

    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float  # the decoder layers' saved activations at the start of backward
    logits_gib: float = 0.0  # the loss's logits (one chunk) and their gradient
    gathered_gib: float = 0.0  # FSDP's all-gathered compute-dtype weights: the root's, and two layers'
    head_grads_gib: float = 0.0  # lm_head's gradient, there as backward starts

    @property
    def total_gib(self) -> float:
        start_of_backward = self.head_grads_gib + self.activations_gib + self.logits_gib
        return self.params_gib + self.optimizer_gib + self.gathered_gib + max(self.grads_gib, start_of_backward)


def estimate_memory(cfg: WorkflowConfig) -> MemoryEstimate:
    """Per-rank memory for parameters, gradients, optimizer state and activations.

    Under FSDP2 a rank holds ``1 / (tp x dp_shard x cp)`` of every weight, gradient and
    optimizer moment (FSDP2 shards over ``dp_shard x cp``; replicas, ``dp_replicate``,
    each hold a whole copy). A decoder layer's activations split over ``tp`` (heads and
    MLP columns) and ``cp`` (positions); the logits split over ``cp`` only, because
    ``lm_head`` is not tensor-parallel (docs/parallelism.md). With ``cp > 1`` each rank
    also builds the whole sequence's boolean attention mask of the packed documents
    (``seq_len^2`` bytes per sequence), whatever cp is.
    """
    p = num_params(cfg.model)
    world = max(world_size(cfg), 1)
    mesh = mesh_shape(cfg)
    split_seq, split_layer = mesh["cp"], mesh["cp"] * mesh["tp"]
    opt = _optimizer_bytes(cfg.optimizer.name) * p
    low = 2 if cfg.train.mixed_precision != MixedPrecision.no else 4
    spec = spec_of(cfg)
    # Per rank, by how the strategy shards them (its spec's memory terms).
    params, grads, opt = spec.memory(p, opt, low, mesh, world)
    m, t = cfg.model, cfg.train
    hf = effective_config(m)
    hidden, vocab = int(hf.get("hidden_size") or m.hidden_size), int(hf.get("vocab_size") or m.vocab_size)
    layers = int(hf.get("num_hidden_layers") or m.num_hidden_layers)
    root = vocab * hidden * (1 if hf.get("tie_word_embeddings", m.tie_word_embeddings) else 2)
    gathered = 0.0
    if spec.gathers_weights:
        # The root unit (embeddings, lm_head) stays gathered through forward and backward; a layer is
        # gathered while the one before it runs (prefetch). Compute dtype, whole (the root not over tp).
        gathered = low * (root + 2 * max(p - root, 0) / max(layers, 1) / mesh["tp"])
    acts = layer_activations(cfg, hf, layers) * t.micro_batch_size * t.seq_len * hidden * low / split_layer
    if split_seq > 1:  # Ulysses: the packed documents' mask over the whole sequence (train/ulysses.py)
        acts += t.micro_batch_size * t.seq_len**2
    # The loss runs lm_head and the cross-entropy over chunks of positions. Compiled, a chunk's logits
    # and their gradient are alive in the compute dtype; eager, three fp32 copies (the upcast logits'
    # log-softmax, its gradient, and the gradient of the upcast).
    chunk = min(t.micro_batch_size * (t.seq_len - 1) // split_seq, LOSS_CHUNK_TOKENS)
    logits = chunk * vocab * (2 * low if t.compile else 12)
    head = vocab * hidden  # lm_head's gradient is the first backward makes, before any layer frees its activations
    return MemoryEstimate(params / GIB, grads / GIB, opt / GIB, acts / GIB, logits / GIB, gathered / GIB,
                          grads * head / max(p, 1) / GIB)


def layer_activations(cfg: WorkflowConfig, hf: Dict[str, Any], layers: int) -> float:
    """All decoder layers' saved activations at the start of backward, in hidden-size values per token.

    A recomputed layer keeps its input (1), and while backward runs it again one layer holds all of
    its activations. ``ops`` keeps, besides the input, every second matmul's output (k, o and up in a
    Llama layer) and the attention output (train/activation_checkpointing.py).
    """
    m, st = cfg.model, cfg.strategy
    full = LAYER_ACTS_COMPILED if cfg.train.compile else LAYER_ACTS_EAGER
    if cfg.train.float8:
        full -= FLOAT8_SAVING
    ac = st.activation_checkpointing
    if m.gradient_checkpointing or ac == ActivationCheckpointing.full:
        return layers * 1.0 + full
    if ac == ActivationCheckpointing.every_n_layers:
        recomputed = layers // st.activation_checkpointing_every_n_layers
        return recomputed * 1.0 + (layers - recomputed) * full + full
    if ac == ActivationCheckpointing.ops:
        hidden = float(hf.get("hidden_size") or m.hidden_size)
        heads = float(hf.get("num_attention_heads") or m.num_attention_heads)
        kv = float(hf.get("num_key_value_heads") or heads)
        kept = 1.0 + kv / heads + 1.0 + float(hf.get("intermediate_size") or m.intermediate_size) / hidden + 1.0
        return layers * kept + (full - kept)
    return layers * full


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def model_line(m: ModelConfig) -> str:
    """What trains: family, weights, parameters (active ones for MoE), tie and the FSDP wrap unit."""
    count = count_params(m)
    n_exp, k_exp = experts(effective_config(m))
    params = f"{_count(count.total)} parameters"
    if n_exp:
        params += f" ({_count(count.active)} active: {k_exp} of {n_exp} experts per token)"
    weights = f"weights of {m.name_or_path}" if m.init == ModelInit.pretrained else (
        f"random weights, {m.name_or_path}'s architecture" if m.name_or_path else "random weights")
    return (f"{m.name}: {m.model_type} ({m.architecture}), {params}, "
            f"{'tied' if m.tie_word_embeddings else 'untied'} embeddings, wraps {m.decoder_layer_cls}; {weights}")


def summary_lines(cfg: WorkflowConfig) -> List[str]:
    """The human summary printed by the planner."""
    c, t = cfg.cluster, cfg.train
    world, dp = world_size(cfg), data_parallel_size(cfg)
    global_batch = t.micro_batch_size * t.grad_accum_steps * dp
    est = estimate_memory(cfg)
    unit = "GPU" if c.device == Device.cuda else "process"
    lines = [
        "model        " + model_line(cfg.model),
        f"strategy     {cfg.strategy.name.value}, mixed precision {t.mixed_precision.value}",
        f"world size   {world} = {c.nodes} node(s) x {c.processes_per_node} process(es), data parallel {dp}",
        "mesh         " + spec_of(cfg).describe_mesh(mesh_shape(cfg)),
        f"global batch {global_batch} sequences = micro {t.micro_batch_size} x accum {t.grad_accum_steps} x dp {dp}",
        f"tokens/step  {global_batch * t.seq_len:,} (seq_len {t.seq_len}); {t.max_steps} steps "
        f"= {global_batch * t.seq_len * t.max_steps / 1e9:.3g} B tokens",
        f"memory       ~{est.total_gib:.1f} GiB per {unit} (estimate): params {est.params_gib:.1f}, optimizer "
        f"{est.optimizer_gib:.1f}, gathered weights {est.gathered_gib:.1f}, and the larger of grads "
        f"{est.grads_gib:.1f} and activations {est.activations_gib:.1f} + logits {est.logits_gib:.1f} "
        f"+ lm_head grad {est.head_grads_gib:.1f}",
    ]
    if cfg.strategy.context_parallel_size > 1:
        lines.append("context      " + context_parallel_line(cfg))
    lines += data_summary_lines(cfg)  # each source's records, tokens and share (fsdp_workflow.data.summary)
    return lines


def context_parallel_line(cfg: WorkflowConfig) -> str:
    """What each cp rank holds under Ulysses: positions outside attention, heads inside, KV heads split or repeated."""
    s, m, t = cfg.strategy, cfg.model, cfg.train
    cp, tp = s.context_parallel_size, s.tensor_parallel_size
    heads, kv = m.num_attention_heads // tp, m.num_key_value_heads // tp
    r = kv_replication(heads, kv, cp) or 1
    kv_words = (f"{kv * r // cp} of {kv} KV heads" if r == 1 else
                f"{kv * r // cp} of {kv} KV heads repeated x{r} (replicated: fewer KV heads than cp)")
    per_tp = " per tp rank" if tp > 1 else ""
    return (f"{s.context_parallel_impl.value}, cp {cp}: {t.seq_len // cp:,} of {t.seq_len:,} positions per rank; "
            f"inside attention the whole sequence for {heads // cp} of {heads} query heads and {kv_words}{per_tp}")


def memory_warning(cfg: WorkflowConfig) -> str | None:
    """A warning when the estimate exceeds the accelerator's memory, else None."""
    if cfg.cluster.device != Device.cuda:
        return None
    est = estimate_memory(cfg)
    if est.total_gib <= cfg.cluster.gpu_mem_gb:
        return None
    return (
        f"cluster.gpu_mem_gb={cfg.cluster.gpu_mem_gb:g}: the estimate of {est.total_gib:.1f} GiB per GPU "
        "exceeds it. Shard more (more nodes, strategy=fsdp2 or deepspeed_zero3), turn on "
        "strategy.activation_checkpointing=full, or lower train.micro_batch_size."
    )
