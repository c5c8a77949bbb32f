"""What the planner knows of one strategy: :class:`StrategySpec`, its torch-free half.

As torchtitan's ``ModelSpec`` bundles what a model brings (its parallelize function,
its state-dict adapter), a spec bundles what a distribution strategy brings to
planning: its Accelerate variables, how it says its mesh, its memory terms, the
rules only it needs, and the yes/no answers the shared rules ask of it. The
trainer's half (wrapping, checkpointer) is ``fsdp_workflow.train.strategies``,
keyed by the same :class:`~fsdp_workflow.config.schema.StrategyName`.

The schema builds ``StrategyName`` from the specs' names, so a spec names its strategy
with a plain string and imports nothing of the schema at import time (its types only).
No torch import here: planning must stay fast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Tuple

from fsdp_workflow.config.choices import ActivationCheckpointing
from fsdp_workflow.config.errors import Rule

if TYPE_CHECKING:  # the schema lists these specs: its types only, never at import time
    from fsdp_workflow.config.schema import StrategyConfig, WorkflowConfig

# (params, gradients, optimizer state) in bytes per rank, from: parameter count, the optimizer's
# bytes unsharded, bytes per parameter in the compute dtype, the mesh ({dim: size}) and the world size.
MemoryTerms = Callable[[float, float, int, Dict[str, int], int], Tuple[float, float, float]]


def changed(s: StrategyConfig, names: Tuple[str, ...]) -> List[str]:
    """Fields set away from the schema default (so the user asked for them)."""
    defaults = {f.name: f.default for f in dataclasses.fields(s)}
    return [n for n in names if getattr(s, n) != defaults[n]]


def no_env(cfg: WorkflowConfig) -> Dict[str, str]:
    """A strategy that Accelerate sets up from the common variables alone."""
    return {}


@dataclass(frozen=True)
class StrategySpec:
    """One distribution strategy, as planning and validation see it.

    The fields answer the questions code used to ask of the strategy's name; a new
    strategy answers them once, here, instead of in every module that branched.
    """

    name: str  # its member of StrategyName (name and value), which the schema builds from the specs
    memory: MemoryTerms  # bytes per rank of params, grads and optimizer state (plan/estimate.py)
    held: str = ""  # how the model is held, said after the rank count when the spec builds no mesh
    accelerate_fsdp: bool = False  # ACCELERATE_USE_FSDP: Accelerate's FSDP plugin; the FSDP knobs apply
    accelerate_deepspeed: bool = False  # ACCELERATE_USE_DEEPSPEED: DeepSpeed's plugin; its knobs apply
    env: Callable[[WorkflowConfig], Dict[str, str]] = no_env  # its own Accelerate variables, after the common ones
    builds_mesh: bool = False  # the 4-D mesh (dp_replicate x dp_shard x cp x tp); others refuse all but dp_shard
    gathers_weights: bool = False  # FSDP units gather their weights in forward/backward (the estimate's term)
    # activation_checkpointing modes it applies (none aside); empty: an FSDP-only knob it ignores
    activation_checkpointing: FrozenSet[ActivationCheckpointing] = frozenset()
    # why train.ema_decay is refused ("the EMA of the weights is ..."); None: train/ema.py averages its shards
    ema: Optional[str] = "not implemented for this strategy"
    float8: bool = False  # train.float8's converted linear layers train under it (rules_float8)
    compile_measured: bool = False  # train.compile: null turns compile on (CUDA, no tp or cp): measured
    zero_stage: Optional[int] = None  # the ZeRO stage its name stands for (DeepSpeed)
    rules: Tuple[Rule, ...] = field(default=())  # checks only this strategy needs (rules_strategy runs them)

    def describe_mesh(self, shape: Dict[str, int]) -> str:
        """The mesh as the planner's summary and the trainer's log say it.

        A spec that builds the mesh names every dimension (``dp_replicate 1 x dp_shard 4 x
        cp 1 x tp 2``). The others build none (validation refuses their replicas, CP and TP):
        every rank is a data-parallel rank, and :attr:`held` says how the model is held, so
        that a DDP run does not read as sharded.
        """
        if self.builds_mesh:
            return " x ".join(f"{dim} {size}" for dim, size in shape.items())
        return f"none ({self.name}): {math.prod(shape.values())} data-parallel rank(s); {self.held}"
