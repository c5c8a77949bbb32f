"""The device mesh, ``dp_replicate x dp_shard x cp x tp``, built once per run from the typed config.

The sizes come from ``cfg.strategy`` through :func:`fsdp_workflow.config.schema.mesh_shape`,
the same function the planner uses for its summary and for the
``PARALLELISM_CONFIG_*`` variables it writes into ``launch.env`` for Accelerate;
the trainer never reads those back. A mesh with only ``dp_shard`` above 1 is
plain FSDP2. The order is Accelerate's, outermost first, so a TP group is
consecutive ranks, which torchrun puts on one node, and replicas are the
outermost blocks of ranks, which are whole nodes when ``dp_replicate`` divides
``cluster.nodes``.

Global rank ``r = ((i_rep * S + i_shard) * C + i_cp) * T + i_tp``: the ranks
that see the same batch (TP and CP peers) share ``r // (C * T)``, which is the
data-parallel rank (:attr:`TrainMesh.dp_rank`). CP peers hold different slices of
that batch's positions (:mod:`.ulysses`) and the same weights, so FSDP2 shards over
``dp_shard x cp`` flattened (torchtitan's ``dp_shard_cp``), and its gradient
reduction sums their contributions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from fsdp_workflow.config.schema import MESH_DIMS, ContextParallelImpl, StrategyName, WorkflowConfig, mesh_shape, world_size
from fsdp_workflow.config.strategies import spec


class StrategyError(RuntimeError):
    """The config asks for a strategy, mesh or feature this machine, install or model cannot run (exit 2)."""


@dataclass(frozen=True)
class MeshDims:
    """Sizes of the four mesh dimensions (their product is the world size)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, cfg: WorkflowConfig, world: int) -> "MeshDims":
        """The mesh ``cfg`` plans, checked against the ``world`` ranks actually launched.

        Raises:
            StrategyError: the planned mesh does not tile ``world`` (launched with another
                number of ranks than planned), or context parallelism other than Ulysses (not built).
        """
        shape = mesh_shape(cfg)
        rep, cp, tp = shape["dp_replicate"], shape["cp"], shape["tp"]
        impl = cfg.strategy.context_parallel_impl
        if cp > 1 and impl != ContextParallelImpl.ulysses:
            raise StrategyError(f"strategy.context_parallel_impl={impl.value} is not built; plan the run again with "
                                "strategy.context_parallel_impl=ulysses (see docs/parallelism.md)")
        if world % (rep * cp * tp):
            raise StrategyError(
                f"the planned mesh (dp_replicate {rep} x cp {cp} x tp {tp}) does not divide the world size "
                f"{world}: launch as many ranks as cluster.nodes x cluster.processes_per_node planned")
        shard = world // (rep * cp * tp)
        # Plain FSDP2 shards over whatever world was launched; a planned 2-D+ mesh must be launched as planned.
        if (rep > 1 or cp > 1 or tp > 1) and shard != shape["dp_shard"]:
            raise StrategyError(
                f"the run plans dp_shard {shape['dp_shard']} ({world_size(cfg)} ranks) but {world} ranks give "
                f"dp_shard {shard}: launch as many ranks as cluster.nodes x cluster.processes_per_node planned "
                "(or re-plan the run)")
        return cls(rep, shard, cp, tp)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def peers(self) -> int:
        """Ranks that see the same batch (``cp x tp``)."""
        return self.cp * self.tp

    @property
    def token_copies(self) -> int:
        """Ranks that hold the same tokens (``tp``): each counts them once in a world-wide sum (CP peers hold
        different slices, so their counts add up to the batch's)."""
        return self.tp

    @property
    def grad_averaged_over(self) -> int:
        """Ranks FSDP2's gradient reduction averages over: ``dp_replicate x dp_shard x cp``."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def plain(self) -> bool:
        """Only ``dp_shard`` is above 1: plain FSDP2 over the world."""
        return self.dp_replicate == 1 and self.cp == 1 and self.tp == 1

    def describe(self, strategy: Optional[StrategyName] = None) -> str:
        """As the planner says it (:meth:`~fsdp_workflow.config.strategies.StrategySpec.describe_mesh`).

        Without a strategy: every dimension, as a strategy that builds the mesh says it.
        """
        shape = dict(zip(MESH_DIMS, self.shape))
        if strategy is None:
            return " x ".join(f"{dim} {size}" for dim, size in shape.items())
        return spec(strategy).describe_mesh(shape)


@dataclass
class TrainMesh:
    """This rank's place in the mesh, and the ``DeviceMesh`` itself (built on first use, once).

    Args:
        dims: the sizes.
        rank: this process's global rank.
        device_type: ``cpu`` or ``cuda``.
    """

    dims: MeshDims
    rank: int
    device_type: str
    _mesh: Optional[Any] = field(default=None, repr=False)
    _shard_cp: Optional[Any] = field(default=None, repr=False)  # the flattened dp_shard x cp mesh, with cp > 1

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank: which slice of each global batch this rank (and its TP/CP peers) takes."""
        return self.rank // self.dims.peers

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def cp_rank(self) -> int:
        """Which slice of each sample's positions this rank holds (0 without context parallelism)."""
        return (self.rank // self.dims.tp) % self.dims.cp

    @property
    def device_mesh(self) -> Any:
        """The 4-D ``DeviceMesh`` named ``dp_replicate, dp_shard, cp, tp`` (needs a process group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, self.dims.shape, mesh_dim_names=MESH_DIMS)
            if self.dims.cp > 1:  # FSDP2's shard dimension (fsdp_mesh): CP peers train the same weights
                # Kept, not sliced from the root again: torch 2.13 warns (on every rank) that slicing a
                # flattened dimension from the root mesh is deprecated.
                self._shard_cp = self._mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return self._mesh

    def fsdp_mesh(self) -> Any:
        """What FSDP2 shards over: ``dp_shard`` (``dp_shard x cp`` flattened with cp), and ``dp_replicate`` before
        it (HSDP) with replicas."""
        shard = "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"
        if self.dims.dp_replicate > 1:  # (with cp, torch still warns here: no API composes a kept flattened mesh)
            return self.device_mesh["dp_replicate", shard]
        if self.dims.cp > 1:
            self.device_mesh  # noqa: B018 - builds the mesh, and with it the flattened dimension
            return self._shard_cp
        return self.device_mesh[shard]

    def sequence_shards(self) -> Any:
        """The ``cp`` group as :class:`.ulysses.SequenceShards` (None without context parallelism)."""
        if self.dims.cp == 1:
            return None
        from fsdp_workflow.train.ulysses import SequenceShards

        return SequenceShards(self.device_mesh["cp"].get_group(), self.dims.cp, self.cp_rank)

    def tp_mesh(self) -> Any:
        return self.device_mesh["tp"]


def tensor_parallel_plan(model: Any) -> dict[str, Any]:
    """``{module fqn: ParallelStyle}`` from the ``base_model_tp_plan`` transformers ships with the config.

    ``colwise`` and ``rowwise`` become ``torch.distributed.tensor.parallel``'s
    ``ColwiseParallel`` and ``RowwiseParallel`` (local outputs: attention reshapes
    to ``-1`` heads, so each rank runs its own heads and MLP columns, and the
    row-parallel output projections all-reduce). Embeddings, norms and ``lm_head``
    are not split over TP: FSDP2 shards them over the data-parallel ranks, and the
    chunked loss keeps ``lm_head`` whole so that its logits need no gather.

    Raises:
        StrategyError: the model ships no plan, or a style other than colwise/rowwise.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    name = type(model).__name__
    if not plan:
        raise StrategyError(f"strategy.tensor_parallel_size > 1, but transformers ships no base_model_tp_plan "
                            f"for {name}: use strategy.tensor_parallel_size=1 (FSDP2 alone) for this model")
    odd = sorted({style for style in plan.values() if style not in styles})
    if odd:
        raise StrategyError(f"{name}'s base_model_tp_plan uses {odd}; the trainer applies only {sorted(styles)}: "
                            "use strategy.tensor_parallel_size=1 for this model")
    prefix = model.base_model_prefix
    patterns = [(re.compile(re.escape(f"{prefix}.{pat}").replace(r"\*", r"\d+") + "$"), styles[style])
                for pat, style in plan.items()]
    out = {fqn: style() for fqn, _ in model.named_modules() for rx, style in patterns if rx.match(fqn)}
    if not out:
        raise StrategyError(f"{name}'s base_model_tp_plan matches none of its modules: "
                            "use strategy.tensor_parallel_size=1 for this model")
    return out


def apply_tensor_parallel(model: Any, tp_mesh: Any) -> None:
    """Split the decoder layers' projections over ``tp_mesh`` (before FSDP2; meta models too)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
