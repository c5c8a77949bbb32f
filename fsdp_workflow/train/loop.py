"""The per-rank training recipe: one readable file, top to bottom.

Run on every rank, by torchrun (or ``accelerate launch``) with the variables of
``RUN_DIR/launch.env`` in the environment::

    set -a; . RUN_DIR/launch.env; set +a
    torchrun --nproc_per_node 2 --standalone -m fsdp_workflow.train RUN_DIR

Steps: process group and ``Accelerator()`` from the environment; tokenizer and
packed data; model built and wrapped by :mod:`.parallel`; optimizer and
schedule; resume from the newest complete checkpoint; then per optimizer step:
reseed, ``grad_accum_steps`` micro-batches, clip, step, one all-reduce carrying
the loss and the preemption flag, metrics, maybe evaluate, maybe checkpoint.

Exit codes (:mod:`fsdp_workflow.core.exit_codes`): 0 done, 2 bad config, 75 preempted
(a checkpoint of the current step was saved; requeue), 1 anything else.
Rank 0 also writes ``RUN_DIR/train_exit.json`` with the code, the reason and the
last checkpoint, because ``torchrun`` reports any non-zero worker exit as 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import Device, WorkflowConfig
from fsdp_workflow.core.exit_codes import EXIT_OK, EXIT_REQUEUE
from fsdp_workflow.train import model as model_lib
from fsdp_workflow.train import parallel
from fsdp_workflow.train.checkpoint import Checkpointer, save_hf_assets
from fsdp_workflow.train.data import RankBatches, build_sources
from fsdp_workflow.train.metrics import MetricsLogger, flops_per_token, guess_peak_tflops
from fsdp_workflow.train.optim import build_optimizer, build_scheduler
from fsdp_workflow.train.signals import PreemptionFlag
from fsdp_workflow.train.tokenizer import load_tokenizer

# Model types whose *ForCausalLM forward is "decoder, then lm_head": for these the
# loss runs chunked over positions (install_chunked_loss_forward); others use HF's.
CHUNKED_LOSS_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def _device_is_cpu(cfg: WorkflowConfig) -> bool:
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
        return True
    return cfg.cluster.device == Device.cpu or not torch.cuda.is_available()


def init_distributed(cfg: WorkflowConfig) -> None:
    """Create the default process group from torchrun's variables (gloo on CPU, nccl + gloo on CUDA).

    Done before ``Accelerator()`` (which then reuses it) so that CPU runs with one
    process still get a group for FSDP2, and CUDA runs get a CPU backend too
    (DCP's async save needs one).
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    timeout = timedelta(seconds=cfg.cluster.rdzv_timeout_s)
    if _device_is_cpu(cfg):
        dist.init_process_group("gloo", timeout=timeout)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``step`` on ``rank``: reseeding each step makes resume exact without saving RNG state."""
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


def install_loss_forward(model: torch.nn.Module, model_type: str, compile_loss: bool = False) -> None:
    """Give the bare model ``forward(input_ids, labels) -> mean loss``."""
    if model_type in CHUNKED_LOSS_MODEL_TYPES:
        model_lib.install_chunked_loss_forward(model, compile_loss=compile_loss)
        return
    hf_forward = model.forward

    def forward(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return hf_forward(input_ids=input_ids, labels=labels).loss

    model.forward = forward  # type: ignore[method-assign]


def compile_layers(model: torch.nn.Module, layer_names: list[str]) -> None:
    """``torch.compile`` each decoder layer's forward in place.

    FSDP's hooks stay outside the compiled regions (they run in ``Module.__call__``)
    and parameter names, hence checkpoint keys, do not change.
    """
    layer_classes = model_lib.decoder_layer_classes(getattr(model, "module", model), layer_names)
    for m in model.modules():
        if isinstance(m, layer_classes):
            m.forward = torch.compile(m.forward)  # type: ignore[method-assign]


def main(run_dir_arg: str) -> int:
    """Train the run in ``run_dir_arg`` on this rank; return the process exit code."""
    run_dir = Path(run_dir_arg).resolve()
    cfg = load_run_config(run_dir)
    strategy = parallel.requested_strategy()
    parallel.check_strategy_available(strategy, "cpu" if _device_is_cpu(cfg) else "cuda")
    init_distributed(cfg)

    from accelerate import Accelerator

    accelerator = Accelerator()
    device = accelerator.device
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    grad_accum = accelerator.gradient_accumulation_steps
    mb, seq_len = cfg.train.micro_batch_size, cfg.train.seq_len
    torch.manual_seed(cfg.train.seed)

    flag = PreemptionFlag().install()

    # ---------------------------------------------------------------- data
    tokenizer = load_tokenizer(cfg.model)
    train_src, held_src = build_sources(cfg.data, tokenizer, seq_len, cfg.model.vocab_size)
    batches = RankBatches(train_src, mb, rank, world)

    # ---------------------------------------------------------------- model + strategy
    holder: dict[str, Any] = {}

    def build(meta: bool) -> torch.nn.Module:
        m = model_lib.build_model(cfg.model, seed=cfg.train.seed, meta=meta)
        holder.setdefault("config", m.config)
        holder.setdefault("generation_config", getattr(m, "generation_config", None))
        return m

    prepared = parallel.prepare(
        accelerator,
        strategy,
        build,
        lambda m: build_optimizer(m.parameters(), cfg.optimizer, device.type),
        lambda m: install_loss_forward(m, cfg.model.model_type, compile_loss=cfg.train.compile),
        micro_batch_size=mb,
    )
    model = prepared.model
    optimizer = prepared.optimizer
    scheduler = build_scheduler(prepared.torch_optimizer, cfg.optimizer, cfg.train.max_steps)
    if cfg.train.compile:
        compile_layers(model, [c.strip() for c in cfg.model.decoder_layer_cls.split(",")])

    if rank == 0:
        save_hf_assets(run_dir, _AssetsView(holder), tokenizer)

    num_params = sum(p.numel() for p in model.parameters())
    unwrapped = getattr(model, "module", model)
    emb = unwrapped.get_input_embeddings().weight.numel() if hasattr(unwrapped, "get_input_embeddings") else 0
    tied = bool(getattr(holder["config"], "tie_word_embeddings", False))
    fpt = flops_per_token(num_params, cfg.model.num_hidden_layers, cfg.model.hidden_size, seq_len, 0 if tied else emb)
    peak = guess_peak_tflops(device.type, cfg.train.peak_tflops)

    # ---------------------------------------------------------------- checkpoints + resume
    async_group = dist.new_group(backend="gloo") if (cfg.checkpoint.async_save and dist.is_initialized()) else None
    ckpt = Checkpointer(run_dir, cfg.checkpoint, rank, async_group)
    step = 0
    resume_from = ckpt.resume_path()
    if resume_from is not None:
        step = _resume(ckpt, resume_from, prepared, scheduler, batches, cfg)

    log = MetricsLogger(run_dir, rank == 0, cfg.train.max_steps, step, cfg.train.log_every_steps)
    if resume_from is not None:
        log.write(f"resumed from {resume_from} at step {step}")
    log.write(
        f"strategy {strategy} ({'fully_shard on ' + device.type if prepared.native_fsdp2 else accelerator.distributed_type}), "
        f"{world} rank(s), {num_params / 1e6:.2f} M parameters, grad_accum {grad_accum}"
    )

    # ---------------------------------------------------------------- train
    exit_code, reason = EXIT_OK, "finished"
    last_saved: Optional[int] = step if resume_from is not None else None
    model.train()
    try:
        while step < cfg.train.max_steps:
            torch.manual_seed(step_seed(cfg.train.seed, step, rank))
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(grad_accum):
                batch = batches.next().to(device, non_blocking=True)
                with parallel.no_sync(prepared, accelerator, enabled=micro < grad_accum - 1):
                    loss = model(input_ids=batch, labels=batch)
                    accelerator.backward(loss)
                loss_sum += loss.detach().float()
            grad_norm = parallel.clip_grad_norm(prepared, accelerator, cfg.optimizer.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # One collective per step: the mean loss and "did any rank get a signal".
            stats = torch.stack([loss_sum / grad_accum, torch.tensor(float(flag.requested), device=device)])
            if dist.is_initialized():
                dist.all_reduce(stats)
            loss_val, stop = stats[0].item() / world, stats[1].item() > 0
            dt = time.perf_counter() - t0
            tokens = world * grad_accum * mb * seq_len
            record = {
                "step": step,
                "loss": loss_val,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens / dt,
                "mfu": tokens / dt * fpt / (world * peak * 1e12),
                "peak_tflops": peak,
                "step_time_s": dt,
                "samples_consumed": batches.position,
            }
            if device.type == "cuda":
                record["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if cfg.train.eval_every_steps and held_src is not None and step % cfg.train.eval_every_steps == 0:
                record["eval_loss"] = _evaluate(model, held_src, cfg, rank, world, device)
            log.log(record)
            ckpt.poll()

            if stop:
                reason = f"preempted ({flag.name or 'signal on another rank'})"
                if last_saved != step:
                    _save(ckpt, prepared, scheduler, batches, step, cfg, blocking=True)
                    last_saved = step
                ckpt.wait()
                exit_code = EXIT_REQUEUE
                break
            every = cfg.checkpoint.every_steps
            if every and step % every == 0:
                _save(ckpt, prepared, scheduler, batches, step, cfg)
                last_saved = step
        if exit_code == EXIT_OK and cfg.checkpoint.save_final and last_saved != step:
            _save(ckpt, prepared, scheduler, batches, step, cfg, blocking=True)
            last_saved = step
        ckpt.wait()
    finally:
        log.close()
        flag.uninstall()

    if rank == 0:
        info = {"exit_code": exit_code, "reason": reason, "step": step,
                "checkpoint": str(run_dir / "checkpoints" / f"step-{last_saved}") if last_saved is not None else None}
        tmp = run_dir / "train_exit.json.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        os.replace(tmp, run_dir / "train_exit.json")
        if exit_code == EXIT_REQUEUE:
            # The job script requeues only when this marker exists (written before the
            # barrier below, so no rank exits, and no srun --kill-on-bad-exit fires, first).
            from fsdp_workflow.core.exit_codes import REQUEUE_MARKER

            (run_dir / REQUEUE_MARKER).write_text(f"step {step}\n")
        print(f"training {reason} at step {step}; exit code {exit_code}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return exit_code


class _AssetsView:
    """What :func:`save_hf_assets` needs of the model, taken from the unwrapped build."""

    def __init__(self, holder: dict[str, Any]):
        self.config = holder["config"]
        self.generation_config = holder.get("generation_config")


def _trainer_state(batches: RankBatches, step: int, cfg: WorkflowConfig) -> dict[str, int]:
    # RNG: every step reseeds from (seed, step, rank) (see step_seed), so the seed and
    # the step are the whole RNG state, valid for any number of ranks.
    return {"step": step, **batches.state_dict(), "seed": cfg.train.seed, "data_seed": cfg.data.seed}


def _state(prepared: parallel.Prepared, scheduler: Any, batches: RankBatches, step: int, cfg: WorkflowConfig) -> dict[str, Any]:
    """The checkpoint's state dict: model and optimizer by FQN (sharded), scheduler, trainer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(prepared.model, prepared.torch_optimizer)
    return {"model": msd, "optimizer": osd, "scheduler": scheduler.state_dict(),
            "trainer": _trainer_state(batches, step, cfg)}


def _save(ckpt: Checkpointer, prepared: parallel.Prepared, scheduler: Any, batches: RankBatches, step: int,
          cfg: WorkflowConfig, blocking: bool = False) -> None:
    if prepared.strategy == "deepspeed":
        client = {"scheduler": scheduler.state_dict(), "trainer": _trainer_state(batches, step, cfg)}
        ckpt.save_deepspeed(step, prepared.model, client)
    else:
        ckpt.save(step, _state(prepared, scheduler, batches, step, cfg), blocking=blocking)


def _resume(ckpt: Checkpointer, path: Path, prepared: parallel.Prepared, scheduler: Any, batches: RankBatches,
            cfg: WorkflowConfig) -> int:
    """Load the checkpoint at ``path`` into everything; return its step."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if prepared.strategy == "deepspeed":
        state = ckpt.load_deepspeed(path, prepared.model)
    else:
        state = _state(prepared, scheduler, batches, 0, cfg)
        ckpt.load(path, state)
        set_state_dict(prepared.model, prepared.torch_optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["trainer"])
    return int(state["trainer"]["step"])


@torch.no_grad()
def _evaluate(model: torch.nn.Module, source: Any, cfg: WorkflowConfig, rank: int, world: int, device: torch.device) -> float:
    """Mean loss over ``train.eval_batches`` held-out micro-batches per rank (same batches every time)."""
    model.eval()
    batches = RankBatches(source, cfg.train.micro_batch_size, rank, world)
    total = torch.zeros((), device=device)
    for _ in range(max(1, cfg.train.eval_batches)):
        batch = batches.next().to(device)
        total += model(input_ids=batch, labels=batch).float()
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return total.item() / (world * max(1, cfg.train.eval_batches))
