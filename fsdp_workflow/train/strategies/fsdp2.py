"""FSDP2: Accelerate's ``fully_shard`` where it serves, ours (:mod:`..parallel`) everywhere else.

* Where Accelerate enabled FSDP (``DistributedType.FSDP``, accelerators) and the run
  needs nothing of ours: ``accelerator.prepare`` does the wrapping, exactly as
  Accelerate users expect.
* Otherwise: on CPU Accelerate reports ``MULTI_CPU`` (DDP), with one process it may
  report ``NO``; a mesh beyond plain FSDP2 (tensor parallelism, replicas:
  :mod:`..mesh`), and the selective activation checkpointing modes
  (:mod:`..activation_checkpointing`) are ours on every device. We apply
  ``torch.distributed.fsdp.fully_shard`` ourselves, per decoder layer and on the
  root, with the options of ``cfg`` (:class:`..parallel.ShardOptions`). So CPU runs
  really shard across gloo ranks.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from fsdp_workflow.config.schema import ActivationCheckpointing, StrategyName
from fsdp_workflow.train.mesh import StrategyError, apply_tensor_parallel
from fsdp_workflow.train.model import non_persistent_buffers, retie
from fsdp_workflow.train.parallel import (
    ModelParts,
    Prepared,
    ShardOptions,
    apply_fully_shard,
    check_same_parameters,
    own_mixed_precision,
    materialize_and_broadcast,
    uses_accelerate_fsdp,
)
from fsdp_workflow.train.strategies.base import TrainStrategy

# Activation checkpointing modes Accelerate's FSDP plugin cannot express: our fully_shard path applies them.
OWN_AC_MODES = (ActivationCheckpointing.every_n_layers, ActivationCheckpointing.ops)


def prepare(parts: ModelParts) -> Prepared:
    """Our ``fully_shard`` path where the run needs it, Accelerate's otherwise."""
    own_mesh = parts.own_mesh
    options = ShardOptions.of(parts.cfg)
    if own_mesh or options.activation_checkpointing in OWN_AC_MODES or not uses_accelerate_fsdp(parts.accelerator):
        return _own_fully_shard(parts, options)
    return _accelerate_fsdp2(parts, options)


def _own_fully_shard(parts: ModelParts, options: ShardOptions) -> Prepared:
    if not dist.is_initialized():
        raise StrategyError(
            "FSDP2 needs a process group: launch with torchrun (it sets RANK, WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT), e.g. `torchrun --nproc_per_node 2 -m fsdp_workflow.train RUN_DIR`."
        )
    device, mesh = parts.accelerator.device, parts.mesh
    rank0 = dist.get_rank() == 0
    lazy = options.cpu_ram_efficient_loading and dist.get_world_size() > 1
    model: nn.Module
    if lazy:
        # Only rank 0 holds the full weights in host memory; others build on meta.
        model = parts.build(not rank0)
        full = {k: v.detach() for k, v in model.state_dict().items()} if rank0 else None
        bufs = {k: v.detach().clone() for k, v in non_persistent_buffers(model).items()} if rank0 else None
        if rank0:
            model = model.to("meta")
            retie(model)  # .to gave the tied output embedding a parameter of its own
    else:
        model = parts.build(False)
    check_same_parameters(model)
    parts.install_forward(model)
    if parts.own_mesh and mesh.dims.tp > 1:
        apply_tensor_parallel(model, mesh.tp_mesh())
    # Plain FSDP2 keeps fully_shard's default mesh (the world): no extra process groups.
    checkpointed = apply_fully_shard(model, options, device, mesh.fsdp_mesh() if parts.own_mesh else None)
    if lazy:
        materialize_and_broadcast(model, full, bufs, device)
        del full, bufs
    else:
        model.to(device)
    optimizer = parts.build_optimizer(model)
    return Prepared(model, optimizer, parts.cfg.strategy.name, native_fsdp2=True, checkpointed_layers=checkpointed,
                    float8_layers=parts.float8_layers)


def _accelerate_fsdp2(parts: ModelParts, options: ShardOptions) -> Prepared:
    accelerator, cfg = parts.accelerator, parts.cfg
    # Accelerate broadcasts rank 0's weights into the sharded model when
    # cpu_ram_efficient_loading is on: the other ranks need only a meta skeleton.
    plugin = accelerator.state.fsdp_plugin
    lazy = bool(getattr(plugin, "cpu_ram_efficient_loading", False)) and not accelerator.is_main_process
    model = parts.build(lazy)
    check_same_parameters(model)  # Accelerate shards whatever each rank built
    # Accelerate's FSDP2 with mixed precision casts parameters itself; adding
    # autocast around forward would only insert no-op casts. Install our forward
    # after prepare so it is not wrapped. Its activation checkpointing (full) comes
    # from FSDP_ACTIVATION_CHECKPOINTING, which the planner wrote from the same key.
    optimizer = parts.build_optimizer(model)
    own_mixed_precision(plugin, options, accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    parts.install_forward(model)
    layers = list(range(cfg.model.num_hidden_layers))
    checkpointed = layers if options.activation_checkpointing == ActivationCheckpointing.full else []
    return Prepared(model, optimizer, cfg.strategy.name, native_fsdp2=False, checkpointed_layers=checkpointed,
                    float8_layers=parts.float8_layers)


SPECS = (TrainStrategy(StrategyName.fsdp2, prepare=prepare),)
