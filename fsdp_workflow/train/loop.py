"""The per-rank training recipe: one readable file, top to bottom.

Run on every rank, by torchrun (or ``accelerate launch``) with the variables of
``RUN_DIR/launch.env`` in the environment::

    set -a; . RUN_DIR/launch.env; set +a
    torchrun --nproc_per_node 2 --standalone -m fsdp_workflow.train RUN_DIR

The strategy, the mesh and every training option come from the typed config in
``RUN_DIR/config.yaml``; ``launch.env`` is for Accelerate and torchrun, and is
never read back here. Steps: process group and ``Accelerator()``; tokenizer and
the prepared token cache, memory-mapped (:mod:`.data`; the trainer never
tokenises: ``python -m fsdp_workflow.data.prepare RUN_DIR`` runs first); model built and wrapped by :mod:`.parallel`; optimizer and
schedule; the trainer state as ``Stateful`` parts (:mod:`.state`) and a
checkpointer for the strategy (:mod:`.checkpointers`); resume from the newest
complete checkpoint; then per optimizer step: reseed, ``grad_accum_steps``
micro-batches (one all-reduce of their trained-token count first, so the loss is
a mean over every trained token of the step, all ranks together), clip, step,
one all-reduce carrying the loss and the preemption flag, metrics, maybe evaluate, maybe checkpoint. After each committed
checkpoint rank 0 runs ``RUN_DIR/post_checkpoint.sh STEP`` if the planner wrote
one (:mod:`.hooks`).

Exit codes (:mod:`fsdp_workflow.core.exit_codes`): 0 done, 2 bad config or the
run directory in use by another trainer (:mod:`.runlock`), 65 the loss or the
gradient norm became NaN/inf (nothing is saved from that step; the last good
checkpoint stays the newest), 74 disk full during a save (the previous
checkpoint is intact), 75 preempted or Ctrl-C (a checkpoint of the current step
was saved; requeue), 76 a collective timed out (the message names the rank and
host that stopped answering, from :mod:`.heartbeat`), 1 anything else.
Rank 0 also writes ``RUN_DIR/train_exit.json`` with the code, the reason and the
last checkpoint, because ``torchrun`` reports any non-zero worker exit as 1.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import ActivationCheckpointing, Device, ModelInit, WorkflowConfig
from fsdp_workflow.core.exit_codes import (EXIT_DISK_FULL, EXIT_NONFINITE, EXIT_OK, EXIT_PEER_TIMEOUT, EXIT_REQUEUE,
                                           EXIT_USAGE)
from fsdp_workflow.core.logs import setup_logging
from fsdp_workflow.core.rundir import RunDir, atomic_write_json, atomic_write_text
from fsdp_workflow.core.versions import installed
from fsdp_workflow.train import model as model_lib
from fsdp_workflow.train import parallel, strategies
from fsdp_workflow.train.activation_checkpointing import compile_unit, compile_units, graph_break_summary
from fsdp_workflow.train.assets import save_hf_assets
from fsdp_workflow.train import fault_hooks, float8, trackers, ulysses
from fsdp_workflow.train.checkpoint import CheckpointDir, Checkpointer, CheckpointSaveError
from fsdp_workflow.train.failures import after_divergence, collective_timeout, peer_timeout_reported, usage_errors
from fsdp_workflow.train.heartbeat import Heartbeat, beat_interval, kill_stopped_local_peers, who_stopped
from fsdp_workflow.train.loss import LossSums, install_loss_forward, router_aux_coef
from fsdp_workflow.train.data import Batch, RankBatches, SampleSource, open_sources, pad_token_id
from fsdp_workflow.train.mesh import MeshDims, TrainMesh
from fsdp_workflow.train.metrics import MetricsLogger, active_parameters, flops_per_token, guess_peak_tflops
from fsdp_workflow.train.optim import build_optimizer, build_scheduler
from fsdp_workflow.train.profiler import StepProfiler
from fsdp_workflow.train.runlock import hold_run_lock
from fsdp_workflow.train.signals import PreemptionFlag
from fsdp_workflow.train.ema import EmaState
from fsdp_workflow.train.state import StepRng, after_optimizer_step, trainer_parts
from fsdp_workflow.data.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- setup
def _device_is_cpu(cfg: WorkflowConfig) -> bool:
    """``cluster.device=cpu``, or a CUDA config on a machine without a GPU (Accelerate falls back to CPU too)."""
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


@dataclass
class Ranks:
    """This process's place: the ``Accelerator`` built from the environment, its device, rank, world and mesh.

    ``rank``/``world`` count processes; ``mesh.dp_rank``/``mesh.dp_size`` count the
    data-parallel ranks, the ones that see different data (TP and CP peers share a batch).
    """

    accelerator: Any
    device: torch.device
    rank: int
    world: int
    mesh: TrainMesh

    @classmethod
    def start(cls, cfg: WorkflowConfig, run: RunDir) -> "Ranks":
        """Join the process group (see :func:`init_distributed`), build ``Accelerator()``, read the mesh.

        The Accelerator carries the experiment trackers of ``train.report_to`` (:mod:`.trackers`).

        Raises:
            StrategyError: the config's mesh does not fit the ranks launched.
        """
        init_distributed(cfg)
        from accelerate import Accelerator

        rank = dist.get_rank() if dist.is_initialized() else 0
        accelerator = Accelerator(**trackers.accelerator_kwargs(cfg, run, is_main=rank == 0))
        world = dist.get_world_size() if dist.is_initialized() else 1
        mesh = TrainMesh(MeshDims.of(cfg, world), rank, accelerator.device.type)
        return cls(accelerator, accelerator.device, rank, world, mesh)

    @property
    def grad_accum(self) -> int:
        return int(self.accelerator.gradient_accumulation_steps)


def compile_layers(model: torch.nn.Module, layer_names: list[str]) -> None:
    """``torch.compile`` each decoder layer's forward in place (a checkpointed layer's with its wrapper).

    FSDP's hooks stay outside the compiled regions (they run in ``Module.__call__``)
    and parameter names, hence checkpoint keys, do not change.
    """
    layer_classes = model_lib.decoder_layer_classes(getattr(model, "module", model), layer_names)
    for m in compile_units(model, layer_classes):
        compile_unit(m)


@dataclass
class Trainee:
    """The wrapped model and optimizer, its schedule, and the unwrapped build's HF config."""

    prepared: parallel.Prepared
    scheduler: torch.optim.lr_scheduler.LambdaLR
    hf_config: Any
    generation_config: Optional[Any]
    tied: list[tuple[str, str]]  # (alias, owner) parameter names that are one parameter after wrapping
    aux_coef: float  # weight of the router's load-balancing loss in each micro-batch's loss (0: not computed)


def build_trainee(cfg: WorkflowConfig, ranks: Ranks) -> Trainee:
    """Build the model under ``cfg.strategy``, its optimizer and schedule (and compile layers if asked)."""
    built: dict[str, Any] = {}
    shards = ranks.mesh.sequence_shards()  # cp > 1: Ulysses attention over the cp group (None otherwise)

    def build(meta: bool) -> torch.nn.Module:
        m = model_lib.build_model(cfg.model, seed=cfg.train.seed, meta=meta)
        built.setdefault("config", m.config)
        built.setdefault("generation_config", getattr(m, "generation_config", None))
        return m

    prepared = strategies.prepare(
        ranks.accelerator,
        cfg,
        build,
        lambda m: build_optimizer(m.parameters(), cfg.optimizer, ranks.device.type),
        lambda m: install_forward(m, cfg, shards),
        mesh=ranks.mesh,
    )
    bare = getattr(prepared.model, "module", prepared.model)  # DDP and DeepSpeed wrap; FSDP2 does not
    lost = model_lib.untied(bare)
    if lost:  # a bug of a wrapping path, never of the user's config: say which
        raise RuntimeError(f"the tied weights {lost} became separate parameters under strategy="
                           f"{cfg.strategy.name.value}; they would train apart. Report this; meanwhile "
                           "strategy.cpu_ram_efficient_loading=false or strategy=ddp keep the tie")
    scheduler = build_scheduler(prepared.torch_optimizer, cfg.optimizer, cfg.train.max_steps)
    if cfg.train.compile:
        compile_layers(prepared.model, [c.strip() for c in cfg.model.decoder_layer_cls.split(",")])
    coef = router_aux_coef(cfg.model.router_aux_loss_coef, built["config"])
    return Trainee(prepared, scheduler, built["config"], built["generation_config"],
                   model_lib.tied_parameter_names(bare), coef)


def install_forward(model: torch.nn.Module, cfg: WorkflowConfig, shards: Optional[ulysses.SequenceShards]) -> None:
    """The loss forward (:mod:`.loss`), and with cp > 1 the Ulysses attention around it (:mod:`.ulysses`)."""
    install_loss_forward(model, compile_loss=cfg.train.compile,
                         router_loss=router_aux_coef(cfg.model.router_aux_loss_coef, model.config) > 0,
                         gather=shards.gather_tokens if shards is not None else None)
    if shards is not None:
        ulysses.install(model, shards)


def model_flops_per_token(trainee: Trainee, cfg: WorkflowConfig) -> tuple[int, int, float]:
    """The parameter count, the count one token runs through (MoE: ``top_k`` of its experts), and training
    FLOPs per token from the active count (tied embeddings count once), all from the model as built."""
    model = trainee.prepared.model
    hf = trainee.hf_config
    numels = [(n, p.numel()) for n, p in model.named_parameters()]
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    active = active_parameters(numels, experts, getattr(hf, "num_experts_per_tok", None))
    unwrapped = getattr(model, "module", model)
    emb = unwrapped.get_input_embeddings().weight.numel() if hasattr(unwrapped, "get_input_embeddings") else 0
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    fpt = flops_per_token(active, hf.num_hidden_layers, hf.hidden_size, cfg.train.seq_len, 0 if tied else emb)
    return sum(n for _, n in numels), active, fpt


# ---------------------------------------------------------------- the run
@dataclass
class Session:
    """Everything one rank trains with; the loop below reads it top to bottom."""

    cfg: WorkflowConfig
    ranks: Ranks
    trainee: Trainee
    batches: RankBatches
    held_out: Optional[SampleSource]
    rng: StepRng
    parts: Mapping[str, Stateful]
    checkpointer: Checkpointer
    log: MetricsLogger
    flag: PreemptionFlag
    flops_per_token: float
    peak_tflops: float
    beat: Heartbeat
    fault: Optional[fault_hooks.TestOnlyFault]  # None unless a reliability test injects one
    run: RunDir  # the run directory (its checkpoints, for the advice after a divergence)
    profiler: StepProfiler  # train.profile_steps (:mod:`.profiler`; does nothing outside its window)


@dataclass
class Outcome:
    """How training ended: the exit code, why, the last step and the last checkpoint saved."""

    exit_code: int
    reason: str
    step: Optional[int]  # None: refused before a step ran (refusals_recorded)
    last_saved: Optional[int]


def main(run_dir_arg: str) -> int:
    """Train the run in ``run_dir_arg`` on this rank; return the process exit code.

    A full disk during a save and a collective that timed out end as named exits
    (:func:`failed_outcome`); anything else propagates as a traceback (exit 1).
    """
    started = time.time()
    run = RunDir.of(Path(run_dir_arg).resolve())
    cfg = load_run_config(run.root)
    setup_logging(cfg.log_level.value)
    strategies.check_strategy_available(cfg.strategy.name, "cpu" if _device_is_cpu(cfg) else "cuda")
    init_distributed(cfg)
    run_lock = hold_run_lock(run)  # before anything is written into the run; released when this process ends
    with refusals_recorded(run):
        ranks = Ranks.start(cfg, run)
        if cfg.train.float8:
            float8.check_available(ranks.device)  # CPU, a GPU below 8.9 or no torchao: exit 2 before the run starts
        beat = Heartbeat(run, ranks.rank, beat_interval(cfg.cluster.rdzv_timeout_s)).start()
        try:
            outcome = run_session(run, cfg, ranks, beat)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            outcome = failed_outcome(exc, run, cfg, ranks, beat, started)
        finally:
            beat.stop()
    if outcome.exit_code in (EXIT_OK, EXIT_REQUEUE, EXIT_NONFINITE) and dist.is_initialized():
        # Rank 0 wrote train_exit.json and .requeue first, so no rank exits (and no
        # srun --kill-on-bad-exit fires) before the job script can read them.
        dist.barrier()
        dist.destroy_process_group()
    del run_lock  # held to here: the kernel frees it at exit in any case
    return outcome.exit_code


def run_session(run: RunDir, cfg: WorkflowConfig, ranks: Ranks, beat: Heartbeat) -> Outcome:
    """Build everything this rank trains with, resume, train, and record how it ended (rank 0)."""
    torch.manual_seed(cfg.train.seed)
    flag = PreemptionFlag().install()

    beat.phase = "loading data and model"
    tokenizer = load_tokenizer(cfg.model)
    train_src, held_src = open_sources(cfg, pad_token_id(tokenizer))
    batches = RankBatches(train_src, cfg.train.micro_batch_size, ranks.mesh.dp_rank, ranks.mesh.dp_size,
                          seq_shard=(ranks.mesh.cp_rank, ranks.mesh.dims.cp))
    trainee = build_trainee(cfg, ranks)
    if ranks.rank == 0:
        base = cfg.model.name_or_path if cfg.model.init == ModelInit.pretrained else None
        save_hf_assets(run, trainee.hf_config, trainee.generation_config, tokenizer, base_dir=base)
    num_params, active, fpt = model_flops_per_token(trainee, cfg)

    rng = StepRng(cfg.train.seed, ranks.mesh.dp_rank)  # TP/CP peers draw the same numbers
    ema = EmaState.maybe(cfg.train, trainee.prepared.model, cfg.strategy.name)  # before resume: starts as the weights
    parts = trainer_parts(trainee.prepared.model, trainee.prepared.torch_optimizer, trainee.scheduler, rng, batches,
                          ema, cfg.optimizer.name)
    checkpoints = CheckpointDir(run, cfg.checkpoint.keep_last, ranks.rank)
    checkpointer = strategies.make_checkpointer(checkpoints, cfg.checkpoint, trainee.prepared, cfg.cluster.rdzv_timeout_s)
    beat.phase = "resuming"
    resume_from = checkpoints.resume_path(cfg.checkpoint.resume)
    if resume_from is not None:
        checkpointer.load(resume_from, parts)

    trackers.start(ranks.accelerator, cfg, run)
    if ranks.rank == 0:
        trackers.forget_steps_after(ranks.accelerator, rng.step)  # one record per step after any resume
    log = MetricsLogger(run.metrics, ranks.rank == 0, cfg.train.max_steps, rng.step, cfg.train.log_every_steps,
                        on_record=trackers.metrics_hook(ranks.accelerator))
    if resume_from is not None:
        log.write(f"resumed from {resume_from} at step {rng.step}")
    prepared = trainee.prepared
    wrapping = f"fully_shard on {ranks.device.type}" if prepared.native_fsdp2 else ranks.accelerator.distributed_type
    log.write(f"strategy {cfg.strategy.name.value} ({wrapping}), {ranks.world} rank(s), mesh "
              f"{ranks.mesh.dims.describe(cfg.strategy.name)}, {num_params / 1e6:.2f} M parameters"
              f"{f' ({active / 1e6:.2f} M active per token)' if active != num_params else ''}, "
              f"grad_accum {ranks.grad_accum}")
    if trainee.aux_coef > 0:
        log.write(f"router load-balancing loss: coefficient {trainee.aux_coef:g} (model.router_aux_loss_coef), "
                  "logged as aux_loss")
    if prepared.native_fsdp2:
        units = parallel.shard_units(prepared.model)
        log.write("fully_shard units: " + ", ".join(f"{n} x {name}" for name, n in units.items()))
    for alias, owner in trainee.tied:
        log.write(f"tied: {alias} is {owner} (one parameter, trained once)")
    ac = cfg.strategy.activation_checkpointing
    if ac != ActivationCheckpointing.none:
        log.write(f"activation checkpointing {ac.value}: decoder layers {prepared.checkpointed_layers}")
    if cfg.train.float8:
        log.write(f"float8: {len(prepared.float8_layers)} linear layers converted (lm_head and small layers "
                  "stay in high precision)")

    session = Session(cfg, ranks, trainee, batches, held_src, rng, parts, checkpointer, log, flag, fpt,
                      guess_peak_tflops(ranks.device.type, cfg.train.peak_tflops), beat, fault_hooks.from_env(),
                      run, StepProfiler(cfg.train.profile_steps, run, ranks.rank, ranks.device))
    try:
        outcome = train(session, resumed=resume_from is not None)
        if ranks.rank == 0:
            record_exit(run, outcome)
    finally:
        log.close()
        trackers.finish(ranks.accelerator)
        flag.uninstall()
        checkpointer.close()  # the last post-checkpoint hook may still need its checkpoint
        session.profiler.close()  # a run stopped inside the window writes what it recorded
    return outcome


def failed_outcome(exc: BaseException, run: RunDir, cfg: WorkflowConfig, ranks: Ranks, beat: Heartbeat,
                   started: float) -> Outcome:
    """A full disk or a collective timeout as a named :class:`Outcome` (recorded); anything else re-raised.

    ``started`` is when this process began: a peer-timeout report another rank wrote
    since then stands (:func:`~fsdp_workflow.train.failures.peer_timeout_reported`).

    Raises:
        BaseException: ``exc`` itself when it is neither.
    """
    latest = run.latest_checkpoint()
    last_saved = latest[0] if latest else None
    if isinstance(exc, CheckpointSaveError):
        outcome = Outcome(EXIT_DISK_FULL, f"{exc} (checkpoints: {run.checkpoints}; the previous checkpoint "
                          f"{last_saved if last_saved is not None else '(none)'} is intact). Free space or set "
                          "checkpoint.keep_last lower, then resubmit with checkpoint.resume=auto", beat.step, last_saved)
    elif collective_timeout(exc) is not None:
        who = who_stopped(run, ranks.world, ranks.rank)
        outcome = Outcome(EXIT_PEER_TIMEOUT, f"rank {ranks.rank} waited {cfg.cluster.rdzv_timeout_s} s "
                          f"(cluster.rdzv_timeout_s) in '{beat.phase}' and timed out: {who}", beat.step, last_saved)
        kill_stopped_local_peers(run, ranks.world, ranks.rank)
    else:
        raise exc
    # A timeout is seen by the ranks still answering, which may not include rank 0.
    first_report = outcome.exit_code != EXIT_PEER_TIMEOUT or not peer_timeout_reported(run.root, started)
    if (ranks.rank == 0 or outcome.exit_code == EXIT_PEER_TIMEOUT) and first_report:
        record_exit(run, outcome)
    else:
        logger.error("rank %d: %s", ranks.rank, outcome.reason)
    return outcome


def train(s: Session, resumed: bool) -> Outcome:
    """Run optimizer steps up to ``train.max_steps``, checkpointing as configured; stop early on a signal.

    Args:
        s: the session.
        resumed: the current step was loaded from a checkpoint (so it needs no final save).

    Returns:
        How training ended.
    """
    cfg = s.cfg

    def save(step: int, parts: Mapping[str, Stateful], blocking: bool = False) -> None:
        s.beat.phase = f"saving step {step}"
        s.checkpointer.save(step, parts, blocking=blocking)
    last_saved = s.rng.step if resumed else None
    every = cfg.checkpoint.every_steps
    first_step = s.rng.step
    s.trainee.prepared.model.train()
    while s.rng.step < cfg.train.max_steps:
        s.beat.step = s.rng.step
        s.beat.phase = f"step {s.rng.step + 1}"
        if s.fault is not None:
            s.fault.at_step(s.rng.step + 1, s.ranks.rank)
        with s.profiler.step(s.rng.step + 1):
            record, stop = optimizer_step(s)
        step = s.rng.step
        bad = nonfinite(record)
        if bad:
            # Nothing from this state is saved: no checkpoint, no .requeue, no EMA. An
            # earlier asynchronous save (a good step) is let finish.
            s.log.log(record)
            s.checkpointer.wait()
            value = record["loss" if bad == "loss" else "grad_norm"]
            return Outcome(EXIT_NONFINITE, f"stopped: the {bad} became {value} at step {step}, so nothing from "
                           f"step {step} was saved. {after_divergence(s.run, step, cfg)}", step, last_saved)
        if cfg.train.eval_every_steps and s.held_out is not None and step % cfg.train.eval_every_steps == 0:
            record["eval_loss"] = evaluate(s)
        s.log.log(record)
        if cfg.train.compile and step == first_step + 1:
            summary = graph_break_summary()
            if summary:
                logger.warning(summary)
        s.checkpointer.poll()
        if stop:
            if last_saved != step:
                save(step, s.parts, blocking=True)
                last_saved = step
            s.checkpointer.wait()
            return Outcome(EXIT_REQUEUE, f"preempted ({s.flag.name or 'signal on another rank'})", step, last_saved)
        if every and step % every == 0:
            save(step, s.parts)
            last_saved = step
    if cfg.checkpoint.save_final and last_saved != s.rng.step:
        save(s.rng.step, s.parts, blocking=True)
        last_saved = s.rng.step
    s.checkpointer.wait()
    return Outcome(EXIT_OK, "finished", s.rng.step, last_saved)


def optimizer_step(s: Session) -> tuple[dict[str, Any], bool]:
    """One optimizer step over ``grad_accum`` micro-batches; return its metrics and "stop (a signal)"."""
    prepared, accelerator, device = s.trainee.prepared, s.ranks.accelerator, s.ranks.device
    grad_accum, world, dp_size = s.ranks.grad_accum, s.ranks.world, s.ranks.mesh.dp_size
    copies = s.ranks.mesh.dims.token_copies  # ranks holding the same tokens (TP): each counts them in a world sum
    s.rng.reseed()
    t0 = time.perf_counter()
    batches = [s.batches.next() for _ in range(grad_accum)]
    trained = global_sum(torch.stack([b.num_trained() for b in batches]).sum().to(device)) // copies
    scale = loss_scale(int(trained.item()), s.ranks.mesh.dims.grad_averaged_over, grad_accum)
    coef = s.trainee.aux_coef
    sums = torch.zeros(2, device=device)  # (summed cross-entropy, summed router aux loss) of this rank
    for micro, batch in enumerate(batches):
        batch = batch.to(device)
        with parallel.no_sync(prepared, accelerator, enabled=micro < grad_accum - 1):
            out = forward(prepared.model, batch)
            accelerator.backward(micro_batch_loss(out, scale, coef))
        sums[0] += out.ce.detach().float()
        if out.aux is not None:
            sums[1] += out.aux.detach().float()
    grad_norm = parallel.clip_grad_norm(prepared, accelerator, s.cfg.optimizer.max_grad_norm)
    lr = float(prepared.torch_optimizer.param_groups[0]["lr"])  # what this step uses (set by the schedule)
    prepared.optimizer.step()
    s.trainee.scheduler.step()
    prepared.optimizer.zero_grad(set_to_none=True)
    s.rng.step += 1
    after_optimizer_step(s.parts, s.rng.step)  # the EMA (train/ema.py)

    # One collective per step: the loss sums (cross-entropy, router) and "did any rank get a signal".
    stats = global_sum(torch.cat([sums, torch.tensor([float(s.flag.requested)], device=device)]))
    dt = time.perf_counter() - t0
    # Input tokens, padding included: what the GPUs processed (and what MFU counts, over all ranks).
    tokens = dp_size * grad_accum * s.cfg.train.micro_batch_size * s.cfg.train.seq_len
    num_trained = int(trained.item())
    record: dict[str, Any] = {
        "step": s.rng.step,
        "loss": stats[0].item() / copies / max(num_trained, 1),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens / dt,
        "trained_tokens": num_trained,
        "mfu": tokens / dt * s.flops_per_token / (world * s.peak_tflops * 1e12),
        "peak_tflops": s.peak_tflops,
        "step_time_s": dt,
        "samples_consumed": s.batches.position,
    }
    if coef > 0:  # mean over micro-batches and data-parallel ranks (each batch once): what coef multiplied
        record["aux_loss"] = stats[1].item() / (world * grad_accum)
    if device.type == "cuda":
        record["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record, stats[2].item() > 0


def nonfinite(record: Mapping[str, Any]) -> str:
    """Which of the step's loss and gradient norm is NaN/inf ("loss", "grad norm"), or "" when both are finite.

    Both values were already reduced over all ranks for the metrics line (the loss
    by the step's one all-reduce, the norm by clipping), so every rank takes the
    same decision at the same step with no collective and no device sync added.
    """
    if not math.isfinite(record["loss"]):
        return "loss"
    norm = record.get("grad_norm")
    if norm is not None and not math.isfinite(norm):
        return "grad norm"
    return ""


def loss_scale(num_trained: int, world: int, grad_accum: int) -> float:
    """The factor on each micro-batch's summed loss that makes the step's gradient a mean per trained token.

    The data-parallel reduction averages gradients over ``world`` ranks (FSDP's
    reduce-scatter over ``dp_shard``, or ``dp_shard x cp`` whose CP peers each hold
    the gradient of their slice's tokens, and the all-reduce over ``dp_replicate``;
    TP peers hold parts of one gradient and average nothing) and Accelerate (or
    DeepSpeed) divides each micro-batch's loss by ``grad_accum``; multiplying by
    both and dividing by the step's trained tokens gives the gradient of
    ``(sum of every trained token's loss) / num_trained``.

    Args:
        num_trained: trained tokens of the whole step, every data-parallel rank and micro-batch
            (each batch counted once, not once per TP peer).
        world: the ranks the gradient reduction averages over (``dp_replicate x dp_shard x cp``:
            :attr:`.mesh.MeshDims.grad_averaged_over`; the world size without TP).
        grad_accum: micro-batches per optimizer step.
    """
    return world * grad_accum / max(num_trained, 1)


def micro_batch_loss(out: LossSums, scale: float, aux_coef: float) -> torch.Tensor:
    """What one micro-batch back-propagates: its summed cross-entropy times :func:`loss_scale`, plus
    ``aux_coef`` times its router loss.

    The router loss is already a mean over the micro-batch's positions, as transformers
    adds it (``loss + router_aux_loss_coef * aux_loss``), so it takes no token scaling:
    the data-parallel reduction and Accelerate's division by ``grad_accum`` average it
    over ranks and micro-batches, and the step's gradient is that of
    ``(cross-entropy per trained token of the step) + aux_coef * (mean router loss)``.
    """
    loss = out.ce * scale
    return loss + aux_coef * out.aux if out.aux is not None else loss


def forward(model: torch.nn.Module, batch: Batch) -> LossSums:
    """The summed token loss of ``batch`` and its router loss (the installed forward: :mod:`.loss`)."""
    return model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids)


def global_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over all ranks (``t`` itself without a process group)."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


@torch.no_grad()
def evaluate(s: Session) -> float:
    """Mean loss per trained token over ``train.eval_batches`` held-out micro-batches per rank (same ones every time)."""
    assert s.held_out is not None
    model, cfg, device = s.trainee.prepared.model, s.cfg, s.ranks.device
    model.eval()
    # TP/CP peers evaluate the same batch: the world-wide sums count it once per peer, in both terms.
    batches = RankBatches(s.held_out, cfg.train.micro_batch_size, s.ranks.mesh.dp_rank, s.ranks.mesh.dp_size,
                          seq_shard=(s.ranks.mesh.cp_rank, s.ranks.mesh.dims.cp))
    totals = torch.zeros(2, device=device, dtype=torch.float64)  # (summed loss, trained tokens)
    for _ in range(max(1, cfg.train.eval_batches)):
        batch = batches.next().to(device)
        totals += torch.stack([forward(model, batch).ce.double(), batch.num_trained().double()])
    global_sum(totals)
    model.train()
    return totals[0].item() / max(totals[1].item(), 1.0)


@contextmanager
def refusals_recorded(run: RunDir) -> Iterator[None]:
    """Rank 0 records a usage error (:func:`~.failures.usage_errors`) in ``train_exit.json`` as exit 2, then re-raises.

    ``train/__main__`` prints the error and exits 2; the record is what the job script and
    ``status`` read, as for every other exit (without it status showed the previous attempt's
    exit). Entered only once this process holds the run (:func:`hold_run_lock`): a trainer
    refused because another holds it must not overwrite that run's record.
    """
    try:
        yield
    except usage_errors() as exc:
        if not dist.is_initialized() or dist.get_rank() == 0:
            record_exit(run, Outcome(EXIT_USAGE, str(exc), None, None), announce=False)
        raise


def record_exit(run: RunDir, outcome: Outcome, announce: bool = True) -> None:
    """Rank 0: write ``train_exit.json`` (and ``.requeue`` when preempted) for the job scripts.

    ``announce``: log how training ended (False where the caller reports the error itself).
    """
    checkpoint = str(run.step_dir(outcome.last_saved)) if outcome.last_saved is not None else None
    atomic_write_json(run.train_exit, {"exit_code": outcome.exit_code, "reason": outcome.reason,
                                       "step": outcome.step, "checkpoint": checkpoint,
                                       "versions": installed()})  # the libraries that trained (the model card's)
    if outcome.exit_code == EXIT_REQUEUE:
        # The job script requeues only when this marker exists.
        atomic_write_text(run.requeue_marker, f"step {outcome.step}\n")
    if not announce:
        return
    (logger.info if outcome.exit_code in (EXIT_OK, EXIT_REQUEUE) else logger.error)(
        "training %s at step %d; exit code %d", outcome.reason, outcome.step, outcome.exit_code)
