"""The one interface every container runtime implements, and the policy they share.

A runtime (``container.runtime``) is one :class:`Runtime` subclass, found through
:mod:`fsdp_workflow.container.registry`. It answers four questions, as data:

* **checks**: :meth:`Runtime.issues`, the config and host rules only this runtime has
  (the shared ones, bind syntax and sources, env names, live in ``image_checks.py``);
* **binds**: :meth:`Runtime.bind_arg` spells one :class:`~fsdp_workflow.container.binds.Bind`
  and :attr:`Runtime.unbindable_chars` says what it cannot carry;
* **environment filtering**: :attr:`Runtime.env_filter`, which host variables cross and
  how (``plan/render.py`` writes it as one constant bash program, for every runtime);
* **wrapping**: :meth:`Runtime.command` (what goes in front of a step's argv) and
  :meth:`Runtime.srun_args` (options for runtimes that attach to an srun step, pyxis).

The policy every runtime follows (docs/containers.md): same-path binds, no home,
caches in the run directory, ``--nv``-like GPU access for GPU steps only, and an
``env`` run first inside the image so explicit values win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

from fsdp_workflow.config.errors import Issue
from fsdp_workflow.config.schema import Device, WorkflowConfig, run_layout
from fsdp_workflow.container.binds import Bind
from fsdp_workflow.core.roles import Role

# Steps that run inside the image (a job's role is its step), and whether each uses GPUs when cluster.device=cuda.
STEP_USES_GPU: Dict[Role, bool] = {Role.prepare: False, Role.train: True, Role.consolidate: False, Role.eval: False}

# Host variables that cross into the image: Slurm, rendezvous, launchers, Accelerate, NCCL, torch, CUDA.
PASS_ENV_PREFIXES = (
    "SLURM_", "MASTER_", "PET_", "TORCHELASTIC_", "ACCELERATE_", "FSDP_", "NCCL_", "TORCH_", "CUDA_",
)
PASS_ENV_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")

Issues = Tuple[List[Issue], List[Issue]]


@dataclass(frozen=True)
class EnvFilter:
    """Which host variables cross into the image, and how.

    :func:`fsdp_workflow.plan.render.env_filter_program` turns it into a constant
    bash program run in front of the runtime (no config value is ever part of it):
    variables matching ``drop_prefixes`` are unset; the pass-through ones are
    exported again as ``<export_prefix><NAME>`` (Apptainer honours
    ``APPTAINERENV_<NAME>`` under ``--cleanenv``), or kept as they are with an
    empty prefix; with ``drop_rest`` every other variable is unset, except
    ``keep_host``, which the runtime itself needs on the host (for runtimes that
    pass the whole environment on, as Charliecloud does).
    """

    pass_prefixes: Tuple[str, ...] = PASS_ENV_PREFIXES
    pass_names: Tuple[str, ...] = PASS_ENV_NAMES
    export_prefix: str = "APPTAINERENV_"
    drop_prefixes: Tuple[str, ...] = ("APPTAINERENV_", "SINGULARITYENV_")
    drop_rest: bool = False
    keep_host: Tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerCommand:
    """What runs a step inside the image: ``[env filter] + prefix + step argv``.

    Attributes:
        env_filter: run the host environment through this first, or None.
        prefix: the runtime's argv (``apptainer exec ... IMAGE``) and the in-image ``env``;
            empty without a container.
    """

    env_filter: Optional[EnvFilter]
    prefix: List[str] = field(default_factory=list)


def check_step(step: Role) -> None:
    """Raises ValueError for a step name no wrapper knows."""
    if step not in STEP_USES_GPU:
        raise ValueError(f"unknown container step {step!r}; expected one of {', '.join(STEP_USES_GPU)}")


def uses_gpu(cfg: WorkflowConfig, step: Role) -> bool:
    """Whether ``step`` gets the GPUs (``--nv``).

    Raises:
        ValueError: an unknown step.
    """
    check_step(step)
    return STEP_USES_GPU[step] and cfg.cluster.device == Device.cuda


def explicit_env(cfg: WorkflowConfig) -> Dict[str, str]:
    """Variables set inside the image for every step; ``container.env`` wins over the defaults."""
    cache = run_layout(cfg).cache
    env = {
        "PYTHONNOUSERSITE": "1",  # ~/.local must never shadow the image's packages
        "HF_HUB_OFFLINE": "1",  # models are local directories; compute nodes may have no network
        "XDG_CACHE_HOME": str(cache),  # home is not mounted: HF and torch caches live in the run dir
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    if cfg.cluster.code_snapshot:  # the submitted code wins over a copy installed in the image
        env["PYTHONPATH"] = str(run_layout(cfg).code)
        env["PYTHONSAFEPATH"] = "1"  # and the working directory does not come before it (backends.slurm.scripts)
    env.update(cfg.container.env)
    return dict(sorted(env.items()))


class Runtime:
    """One container runtime: checks, binds, environment filtering, wrapping.

    Subclasses set the class attributes and override what differs; the defaults
    describe a runtime that runs the step itself (``RUNTIME [opts] IMAGE env ... argv``).

    Attributes:
        name: the ``container.runtime`` value (``ContainerRuntime``'s member name).
        in_image: whether steps run inside an image (False only for ``none``).
        image_example: shown in the "needs an image" error, as a ``container.image=`` value.
        build_hint: how to build an image, shown when the image does not exist.
        bind_option: how the runtime's bind option is named in messages.
        unbindable_chars: characters a bound path cannot hold (the runtime splits on them).
        env_filter: how host variables cross, or None when the runtime needs no filter.
        in_image_unset: variables the in-image ``env`` unsets (when the runtime cannot clear them).
    """

    name: ClassVar[str] = ""
    in_image: ClassVar[bool] = True
    image_example: ClassVar[str] = "/path/to/image"
    build_hint: ClassVar[str] = "see docs/containers.md"
    bind_option: ClassVar[str] = "--bind"
    unbindable_chars: ClassVar[Tuple[str, ...]] = (",", ":")
    env_filter: ClassVar[Optional[EnvFilter]] = None
    in_image_unset: ClassVar[Tuple[str, ...]] = ()

    def bind_arg(self, b: Bind) -> str:
        """One bind as this runtime's option value expects it."""
        return f"{b.src}:{b.dst}" + (":ro" if b.read_only else "")

    def unbindable(self, b: Bind) -> List[str]:
        """What in ``b`` this runtime cannot express: characters, or the word ``whitespace``."""
        return [c for c in self.unbindable_chars if c in b.src or c in b.dst]

    def image_path(self, image: str) -> Optional[str]:
        """The local file or directory ``image`` names (it must exist), or None for a reference pulled at start."""
        return image

    def in_image_env(self, cfg: WorkflowConfig) -> List[str]:
        """``env [-u NAME...] K=V...``: run first inside the image, so explicit values win."""
        argv = ["env"]
        for name in self.in_image_unset:
            argv += ["-u", name]
        return argv + [f"{k}={v}" for k, v in explicit_env(cfg).items()]

    def command(self, cfg: WorkflowConfig, step: Role) -> ContainerCommand:
        """What goes in front of ``step``'s argv (``step`` already checked).

        Raises:
            ValueError: a bind that cannot be parsed.
        """
        raise NotImplementedError

    def srun_args(self, cfg: WorkflowConfig, step: Role) -> List[str]:
        """srun options that attach the image to a step (``step`` already checked); none by default."""
        return []

    def issues(self, cfg: WorkflowConfig) -> Issues:
        """``(errors, warnings)``: the config and host rules only this runtime has."""
        return [], []
