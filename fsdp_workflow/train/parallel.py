"""The wrapping pieces the strategies share, and what a prepared model is.

Each strategy's trainer half (``fsdp_workflow.train.strategies``) wraps the model
from the run's typed config (``cfg.strategy``), loaded from ``RUN_DIR/config.yaml``;
``launch.env`` carries the same choices to the tools that read the environment
(Accelerate's ``Accelerator()``, torchrun), and nothing here reads them back.
Here: :class:`ModelParts` (what every strategy is given), :func:`accelerate_prepare`
(``accelerator.prepare``: DDP, FSDP1, DeepSpeed), our own FSDP2 pieces
(:class:`ShardOptions`, :func:`apply_fully_shard`, :func:`materialize_and_broadcast`),
and what the loop asks of any :class:`Prepared` model (:func:`no_sync`, :func:`clip_grad_norm`).

``train.float8`` converts the bare model's large linear layers first (:mod:`.float8`),
whatever the path (:meth:`ModelParts.build`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_workflow.config.schema import (
    ActivationCheckpointing,
    AutoWrapPolicy,
    MixedPrecision,
    StrategyName,
    WorkflowConfig,
)
from fsdp_workflow.train import float8
from fsdp_workflow.train.activation_checkpointing import apply_activation_checkpointing
from fsdp_workflow.train.mesh import StrategyError, TrainMesh
from fsdp_workflow.train.model import decoder_layer_classes, non_persistent_buffers, retie, set_buffer

@dataclass(frozen=True)
class ShardOptions:
    """How our own FSDP2 path wraps the model: the typed config's values, gathered once."""

    layer_names: Optional[list[str]]  # decoder layer classes; None: the model's _no_split_modules
    reshard_after_forward: bool
    offload_params: bool
    mixed_precision: MixedPrecision
    activation_checkpointing: ActivationCheckpointing
    every_n_layers: int
    cpu_ram_efficient_loading: bool

    @classmethod
    def of(cls, cfg: WorkflowConfig) -> "ShardOptions":
        """The options ``cfg`` asks for (``model.decoder_layer_cls`` only under TRANSFORMER_BASED_WRAP)."""
        s = cfg.strategy
        names = None
        if s.auto_wrap_policy == AutoWrapPolicy.TRANSFORMER_BASED_WRAP:
            names = [c.strip() for c in cfg.model.decoder_layer_cls.split(",") if c.strip()]
        return cls(names, s.reshard_after_forward, s.offload_params, cfg.train.mixed_precision,
                   s.activation_checkpointing, s.activation_checkpointing_every_n_layers,
                   s.cpu_ram_efficient_loading)

    def mp_policy(self, device: torch.device) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for ``train.mixed_precision`` (Accelerate's choice of dtypes)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision == MixedPrecision.no:
            return MixedPrecisionPolicy()
        low = torch.bfloat16 if self.mixed_precision == MixedPrecision.bf16 else torch.float16
        # gloo reduces bf16 poorly (and slowly): reduce gradients in fp32 on CPU.
        reduce = torch.float32 if device.type == "cpu" else low
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce, output_dtype=low, cast_forward_inputs=True)


@dataclass
class Prepared:
    """The wrapped model and optimizer, and how they were wrapped."""

    model: nn.Module  # what forward/backward go through
    optimizer: Any  # what .step()/.zero_grad() go through (maybe Accelerate's wrapper)
    strategy: StrategyName  # cfg.strategy.name
    native_fsdp2: bool  # True when we applied fully_shard ourselves
    checkpointed_layers: list[int] = field(default_factory=list)  # decoder layers under activation checkpointing
    float8_layers: list[str] = field(default_factory=list)  # linear layers converted by train.float8

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The underlying ``torch.optim.Optimizer`` (for state dicts and lr)."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        # DeepSpeed's ZeRO optimizers are no torch Optimizer (LambdaLR refuses them);
        # they wrap the client's optimizer one level further, and step its param_groups.
        while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt


def uses_accelerate_fsdp(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def apply_fully_shard(model: nn.Module, options: ShardOptions, device: torch.device,
                      mesh: Optional[Any] = None) -> list[int]:
    """Shard ``model`` with FSDP2 per decoder layer and at the root, as ``options`` say.

    Activation checkpointing wraps the chosen layers first, so the FSDP unit is the
    wrapper. The model may be on the meta device on some ranks
    (``cpu_ram_efficient_loading``); callers then materialise and load it with
    :func:`materialize_and_broadcast`.

    Args:
        model: the bare model (tensor-parallel already, if the mesh has ``tp``).
        options: the config's wrapping options (:meth:`ShardOptions.of`).
        device: where the shards live.
        mesh: the data-parallel sub-mesh (:meth:`.mesh.TrainMesh.fsdp_mesh`; 2-D: HSDP);
            None: the whole world.

    Returns:
        The 0-based indices of the decoder layers under activation checkpointing.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    layer_classes = decoder_layer_classes(model, options.layer_names)
    checkpointed = apply_activation_checkpointing(model, layer_classes, options.activation_checkpointing,
                                                  options.every_n_layers)
    kwargs: dict[str, Any] = {"mp_policy": options.mp_policy(device), "mesh": mesh}
    if options.offload_params and device.type != "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy()

    layers = [m for m in model.modules() if isinstance(m, (CheckpointWrapper, *layer_classes))]
    wrapped_inner = {id(m._checkpoint_wrapped_module) for m in layers if isinstance(m, CheckpointWrapper)}
    for m in layers:
        if id(m) in wrapped_inner:
            continue  # shard the CheckpointWrapper, not the layer inside it
        fully_shard(m, reshard_after_forward=options.reshard_after_forward, **kwargs)
    # The root keeps its parameters (embeddings, final norm, lm_head) gathered after
    # forward: backward needs them first thing, so resharding would only add a gather.
    # Its output is the installed loss forward's fp32 sums: cast to bf16 they would carry
    # 8 bits (a sum over 16k tokens off by up to 0.4%, in the log and the gradient's scale).
    root_policy = replace(kwargs["mp_policy"], output_dtype=None)
    fully_shard(model, reshard_after_forward=False, **{**kwargs, "mp_policy": root_policy})
    return checkpointed


def shard_units(model: nn.Module) -> dict[str, int]:
    """How many modules of each class ``fully_shard`` made a unit of (one all-gather each), root included.

    What the log reports, so a run shows its wrap unit: a mixture of experts is wrapped
    per decoder layer, its experts inside it, never an expert per unit.
    """
    from torch.distributed.fsdp import FSDPModule

    units: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # FSDP2 swaps the class for FSDP<name>; a checkpoint wrapper shards the layer inside it.
            inner = getattr(m, "_checkpoint_wrapped_module", m)
            name = type(inner).__name__.removeprefix("FSDP")
            units[name] = units.get(name, 0) + 1
    return units


def materialize_and_broadcast(
    model: nn.Module,
    full_state: Optional[dict[str, torch.Tensor]],
    buffers: Optional[dict[str, torch.Tensor]],
    device: torch.device,
) -> None:
    """Give a sharded (possibly meta) model its storage and rank 0's weights.

    Args:
        model: sharded with :func:`apply_fully_shard`.
        full_state: rank 0's full ``state_dict`` (None on other ranks).
        buffers: rank 0's non-persistent buffers (rotary tables...); None elsewhere.
        device: where the local shards live.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(
        model,
        full_state if full_state is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    # Non-persistent buffers are not in any state dict: broadcast them too.
    names = sorted(non_persistent_buffers(model))
    for name in names:
        local = non_persistent_buffers(model)[name]
        if buffers is not None:
            src = buffers[name].to(device=device, dtype=local.dtype)
        else:
            src = torch.empty(local.shape, dtype=local.dtype, device=device)
        dist.broadcast(src, src=0)
        set_buffer(model, name, src)
    retie(model)


def check_same_parameters(model: nn.Module) -> None:
    """Fail with a message, before ``fully_shard``, when the ranks built different parameter sets.

    FSDP2 sizes each all-gather by the parameters it wraps: ranks that disagree (a tie
    kept on one rank and lost on another, say) die in the first forward with gloo's
    "76864 vs 38464" or hang on NCCL. One small all-gather of names and shapes turns
    that into the list of what differs.

    Raises:
        StrategyError: some rank holds a parameter (name, shape) rank 0 lacks, or the reverse.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = sorted((n, tuple(p.shape)) for n, p in model.named_parameters())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    problems = []
    for rank, theirs in enumerate(every[1:], start=1):
        extra, missing = sorted(set(theirs) - set(every[0])), sorted(set(every[0]) - set(theirs))
        said = [f"{what} {names[:4]}" for what, names in (("has", extra), ("lacks", missing)) if names]
        if said:
            problems.append(f"rank {rank} {' and '.join(said)} (name, shape) compared with rank 0")
    if problems:
        raise StrategyError("the ranks built different models, so FSDP cannot shard them together: "
                            + "; ".join(problems) + ". This is a bug in how the model was built (a tied weight "
                            "lost on some ranks?); strategy.cpu_ram_efficient_loading=false builds it the same "
                            "way on every rank")


@dataclass
class ModelParts:
    """What every strategy's ``prepare`` is given: how to build, wrap and pair the model."""

    accelerator: Any  # constructed from the environment (its device; the wrapping for Accelerate's paths)
    cfg: WorkflowConfig  # the run's typed config: strategy, wrapping options, train.float8, micro-batch size
    build_model: Callable[[bool], nn.Module]  # build_model(meta): the CPU (or meta) model
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]  # over the (wrapped) model's parameters
    install_forward: Callable[[nn.Module], None]  # installs the loss forward on the bare model
    mesh: Optional[TrainMesh] = None  # the run's device mesh; beyond plain FSDP2 our own path applies it
    float8_layers: list[str] = field(default_factory=list)  # filled by build: the layers train.float8 converted

    @property
    def own_mesh(self) -> bool:
        """The mesh has more than ``dp_shard`` (replicas, cp or tp): only our own FSDP2 path builds it."""
        return self.mesh is not None and not self.mesh.dims.plain

    def build(self, meta: bool) -> nn.Module:
        """The model, its linear layers converted to float8 when ``train.float8`` asks."""
        model = self.build_model(meta)
        if self.cfg.train.float8:
            self.float8_layers[:] = float8.convert(model)
        return model


def accelerate_prepare(parts: ModelParts, before_optimizer: Callable[[], None] = lambda: None) -> Prepared:
    """Build the model, install the forward and let ``accelerator.prepare`` wrap model and optimizer.

    Args:
        parts: what to build and how.
        before_optimizer: runs after the forward is installed, before the optimizer is built
            (DeepSpeed sets its micro-batch size there).
    """
    model = parts.build(False)
    parts.install_forward(model)
    before_optimizer()
    optimizer = parts.build_optimizer(model)
    model, optimizer = parts.accelerator.prepare(model, optimizer)
    return Prepared(model, optimizer, parts.cfg.strategy.name, native_fsdp2=False, float8_layers=parts.float8_layers)


def own_mixed_precision(plugin: Any, options: ShardOptions, device: torch.device) -> None:
    """Give Accelerate's FSDP2 plugin our mixed-precision policy, whatever its version would choose.

    Accelerate applies one policy to every unit, the root included, and its choice moved
    between releases: 1.15 set ``output_dtype`` to the low dtype (FSDP2 then cast the
    root's output, our installed forward's fp32 loss sums, to bf16: 8 bits of mantissa),
    1.16 leaves it None and reduces gradients in the low dtype on every device. So the
    trainer does not inherit it: the policy is :meth:`ShardOptions.mp_policy`, as our own
    FSDP2 path uses, with ``output_dtype`` None because the root shares it. Units
    computing in the low dtype still hand it on, and inputs are still cast.
    (tests/train/test_bf16_loss.py runs both Accelerate choices through this.)
    """
    plugin.mixed_precision_policy = replace(options.mp_policy(device), output_dtype=None)


@contextlib.contextmanager
def no_sync(prepared: Prepared, accelerator: Any, enabled: bool) -> Iterator[None]:
    """Skip gradient reduction for a micro-step that is not the last of an accumulation."""
    if not enabled:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    model = prepared.model
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with accelerator.no_sync(model):
            yield


def clip_grad_norm(prepared: Prepared, accelerator: Any, max_norm: Optional[float]) -> Optional[float]:
    """Clip gradients (None: only measure) and return the global norm as a float."""
    limit = float(max_norm) if max_norm else float("inf")
    if prepared.native_fsdp2:
        return _clip_by_mesh([p.grad for p in prepared.model.parameters() if p.grad is not None], limit)
    norm = accelerator.clip_grad_norm_(prepared.model.parameters(), limit)
    if norm is None:
        return None
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _clip_by_mesh(grads: list[torch.Tensor], limit: float) -> float:
    """The global 2-norm of DTensor gradients that live on different meshes, clipped to ``limit``.

    With tensor parallelism the split projections' gradients live on the 2-D
    ``(dp, tp)`` mesh and the rest (embeddings, norms, ``lm_head``) on the
    data-parallel mesh alone, and torch's ``clip_grad_norm_`` refuses to stack
    norms from different meshes. Each group's norm is reduced over its own mesh
    (``full_tensor``: a parameter replicated over ``tp`` counts once), then combined.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, 2.0, foreach=True)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm(2.0)
    coef = torch.clamp(limit / (total + 1e-6), max=1.0)
    for group in groups.values():
        torch._foreach_mul_(group, coef.item())
    return float(total)
