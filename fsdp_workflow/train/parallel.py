"""Apply the distribution strategy named by the environment (``RUN_DIR/launch.env``).

The environment Accelerate reads is the one source of truth. ``Accelerator()``
builds its plugins from it, and this module follows what it decided:

* ``DistributedType.FSDP`` (accelerators, FSDP1 or FSDP2): ``accelerator.prepare``
  does the wrapping, exactly as Accelerate users expect.
* FSDP2 requested but Accelerate did not enable it (on CPU it reports
  ``MULTI_CPU``, i.e. DDP; with one process it may report ``NO``): we apply
  ``torch.distributed.fsdp.fully_shard`` ourselves, per decoder layer and on the
  root, with the options parsed by Accelerate's own ``FullyShardedDataParallelPlugin()``
  (layer classes, ``reshard_after_forward``, activation checkpointing, mixed
  precision, offload). So CPU runs really shard across gloo ranks.
* A mesh beyond plain FSDP2 (tensor parallelism, replicas: :mod:`.mesh`), on CPU
  and GPU alike: ``torch.distributed.tensor.parallel`` with the plan transformers
  ships, then ``fully_shard`` over the data-parallel sub-mesh. Accelerate's own
  TP path cannot serve (it refuses ``ParallelismConfig`` on CPU, and its FSDP2 +
  TP preparation imports a class transformers 5 removed); both devices read the
  same mesh.
* FSDP1 without an accelerator: a clear error (Accelerate only builds FSDP1 on
  accelerators and we do not hand-roll FlatParameter FSDP on CPU).
* DDP and DeepSpeed: ``accelerator.prepare``. DeepSpeed must be importable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_workflow.train.mesh import StrategyError, TrainMesh, apply_tensor_parallel
from fsdp_workflow.train.model import decoder_layer_classes, non_persistent_buffers, set_buffer


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def requested_strategy() -> str:
    """What ``launch.env`` asks for: ``fsdp2``, ``fsdp1``, ``deepspeed`` or ``ddp``."""
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _env_true("ACCELERATE_USE_FSDP"):
        return "fsdp2" if os.environ.get("FSDP_VERSION", "1").strip() == "2" else "fsdp1"
    return "ddp"


def check_strategy_available(strategy: str, device_type: str) -> None:
    """Fail early, with the fix, when the requested strategy cannot run here.

    Raises:
        StrategyError: DeepSpeed not installed, or FSDP1 without an accelerator.
    """
    # The device first: on CPU the answer must not depend on what happens to be installed.
    if strategy == "deepspeed" and device_type == "cpu":
        raise StrategyError(
            "strategy=deepspeed_zero* needs CUDA GPUs: DeepSpeed's CPU accelerator needs Intel's oneCCL "
            "bindings, which this project does not support. Use strategy=fsdp2 (sharded like ZeRO-3) or "
            "strategy=ddp on CPU."
        )
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise StrategyError(
            "launch.env sets ACCELERATE_USE_DEEPSPEED=true (strategy=deepspeed_zero*), but the "
            "`deepspeed` package is not installed in this environment. Install it "
            "(`pip install 'fsdp_workflow[deepspeed]'`, on a machine with CUDA) or choose "
            "strategy=fsdp2 or strategy=ddp."
        )
    if strategy == "fsdp1" and device_type == "cpu":
        raise StrategyError(
            "strategy=fsdp1 (FSDP_VERSION=1) needs CUDA: Accelerate only enables FSDP on accelerators "
            "and this trainer shards on CPU with FSDP2 only. Use strategy=fsdp2 (recommended; same "
            "checkpoint layout) or strategy=ddp on CPU."
        )


@dataclass
class Prepared:
    """The wrapped model and optimizer, and how they were wrapped."""

    model: nn.Module  # what forward/backward go through
    optimizer: Any  # what .step()/.zero_grad() go through (maybe Accelerate's wrapper)
    strategy: str  # fsdp2 | fsdp1 | ddp | deepspeed
    native_fsdp2: bool  # True when we applied fully_shard ourselves

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


def fsdp_plugin_from_env(mixed_precision: str) -> Any:
    """Accelerate's FSDP plugin parsed from the environment, with mixed precision set."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    return plugin


def apply_fully_shard(model: nn.Module, plugin: Any, device: torch.device, mesh: Optional[Any] = None) -> nn.Module:
    """Shard ``model`` with FSDP2 per decoder layer and at the root, as the plugin says.

    The model may be on the meta device on some ranks (``cpu_ram_efficient_loading``);
    callers then materialise and load it with :func:`materialize_and_broadcast`.

    Args:
        model: the bare model (tensor-parallel already, if the mesh has ``tp``).
        plugin: Accelerate's FSDP plugin, parsed from the environment.
        device: where the shards live.
        mesh: the data-parallel sub-mesh (:meth:`.mesh.TrainMesh.fsdp_mesh`; 2-D: HSDP);
            None: the whole world.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    names = plugin.transformer_cls_names_to_wrap
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    layer_classes = decoder_layer_classes(model, names)

    if plugin.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, layer_classes),
        )

    mp = plugin.mixed_precision_policy
    if mp is not None and device.type == "cpu":
        # gloo reduces bf16 poorly (and slowly): reduce gradients in fp32 on CPU.
        mp = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mp_policy": mp or MixedPrecisionPolicy(), "mesh": mesh}
    if plugin.cpu_offload and device.type != "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    reshard = bool(plugin.reshard_after_forward)

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    layers = [m for m in model.modules() if isinstance(m, (CheckpointWrapper, *layer_classes))]
    wrapped_inner = {id(m._checkpoint_wrapped_module) for m in layers if isinstance(m, CheckpointWrapper)}
    for m in layers:
        if id(m) in wrapped_inner:
            continue  # shard the CheckpointWrapper, not the layer inside it
        fully_shard(m, reshard_after_forward=reshard, **kwargs)
    # The root keeps its parameters (embeddings, final norm, lm_head) gathered after
    # forward: backward needs them first thing, so resharding would only add a gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


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
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def prepare(
    accelerator: Any,
    strategy: str,
    build_model: Callable[[bool], nn.Module],
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    install_forward: Callable[[nn.Module], None],
    micro_batch_size: int = 1,
    mesh: Optional[TrainMesh] = None,
) -> Prepared:
    """Build, wrap and pair the model with its optimizer under ``strategy``.

    Args:
        accelerator: constructed from the environment.
        strategy: :func:`requested_strategy`.
        build_model: ``build_model(meta)`` returns the CPU (or meta) model.
        build_optimizer: makes the optimizer over the (wrapped) model's parameters.
        install_forward: installs the loss forward on the bare model.
        micro_batch_size: sequences per rank per forward (DeepSpeed's config needs it).
        mesh: the run's device mesh; beyond plain FSDP2 (TP, replicas) our own path applies it.

    Returns:
        The prepared model and optimizer.

    Raises:
        StrategyError: a mesh beyond plain FSDP2 under another strategy, or no process group.
    """
    device = accelerator.device
    own_mesh = mesh is not None and not mesh.dims.plain
    if own_mesh and strategy != "fsdp2":
        raise StrategyError(f"launch.env asks for the mesh {mesh.dims.describe()} under {strategy}: "
                            "tensor parallelism and replicas are built for strategy=fsdp2 only")
    if strategy == "fsdp2" and (own_mesh or not uses_accelerate_fsdp(accelerator)):
        if not dist.is_initialized():
            raise StrategyError(
                "FSDP2 needs a process group: launch with torchrun (it sets RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT), e.g. `torchrun --nproc_per_node 2 -m fsdp_workflow.train RUN_DIR`."
            )
        plugin = fsdp_plugin_from_env(accelerator.mixed_precision)
        rank0 = dist.get_rank() == 0
        lazy = bool(plugin.cpu_ram_efficient_loading) and dist.get_world_size() > 1
        if lazy:
            # Only rank 0 holds the full weights in host memory; others build on meta.
            model = build_model(not rank0)
            full = {k: v.detach() for k, v in model.state_dict().items()} if rank0 else None
            bufs = {k: v.detach().clone() for k, v in non_persistent_buffers(model).items()} if rank0 else None
            if rank0:
                model = model.to("meta")
                if hasattr(model, "tie_weights"):
                    model.tie_weights()
        else:
            model = build_model(False)
        install_forward(model)
        if own_mesh and mesh.dims.tp > 1:
            apply_tensor_parallel(model, mesh.tp_mesh())
        # Plain FSDP2 keeps fully_shard's default mesh (the world): no extra process groups.
        apply_fully_shard(model, plugin, device, mesh.fsdp_mesh() if own_mesh else None)
        if lazy:
            materialize_and_broadcast(model, full, bufs, device)
            del full, bufs
        else:
            model.to(device)
        optimizer = build_optimizer(model)
        return Prepared(model, optimizer, strategy, native_fsdp2=True)

    if strategy == "fsdp2":
        # Accelerate broadcasts rank 0's weights into the sharded model when
        # cpu_ram_efficient_loading is on: the other ranks need only a meta skeleton.
        plugin = accelerator.state.fsdp_plugin
        lazy = bool(getattr(plugin, "cpu_ram_efficient_loading", False)) and not accelerator.is_main_process
        model = build_model(lazy)
        # Accelerate's FSDP2 with mixed precision casts parameters itself; adding
        # autocast around forward would only insert no-op casts. Install our forward
        # after prepare so it is not wrapped.
        optimizer = build_optimizer(model)
        model, optimizer = accelerator.prepare(model, optimizer)
        install_forward(model)
        return Prepared(model, optimizer, strategy, native_fsdp2=False)
    model = build_model(False)
    install_forward(model)
    if strategy == "deepspeed":
        ds = accelerator.state.deepspeed_plugin
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    optimizer = build_optimizer(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    return Prepared(model, optimizer, strategy, native_fsdp2=False)


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
