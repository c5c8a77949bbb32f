"""How a step runs inside the image, as data: Apptainer's argv, pyxis's srun options.

Policy, the same for every step (``train``, ``consolidate``, ``evaluate``):

* **Environment.** Apptainer runs with ``--cleanenv``. A constant bash program
  in front of it re-exports only the pass-through variables (Slurm, rendezvous,
  launcher, Accelerate/FSDP, NCCL, torch, CUDA) as ``APPTAINERENV_*``, which
  Apptainer still honours under ``--cleanenv``, and drops any stray
  ``APPTAINERENV_*`` from the user's shell. Everything else is explicit: inside
  the image the step starts as ``env PYTHONNOUSERSITE=1 HF_HUB_OFFLINE=1
  XDG_CACHE_HOME=RUN_DIR/.cache ... <container.env> argv``. pyxis cannot clean
  the task's environment, so there the in-image ``env`` also unsets the
  variables known to shadow an image's Python (``PYTHONPATH``, ``VIRTUAL_ENV``...).
* **Home.** Not mounted (``--no-home``, ``--no-container-mount-home``): no
  ``~/.local`` packages, no host caches; caches go to ``RUN_DIR/.cache``.
* **Binds.** :func:`fsdp_workflow.container.binds.bind_list`, same path inside.
* **GPU.** ``--nv`` for GPU steps only (``train`` with ``cluster.device=cuda``);
  pyxis CPU steps set ``NVIDIA_VISIBLE_DEVICES=void`` so the enroot hook
  leaves the node's (absent) driver alone.

Only data and argument lists here: :class:`ContainerCommand` says what goes in
front of a step's argv, and :mod:`fsdp_workflow.plan.render` writes the env
filter program and quotes everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fsdp_workflow.config.accelerate_env import accelerate_env
from fsdp_workflow.config.schema import ContainerRuntime, Device, WorkflowConfig, run_layout
from fsdp_workflow.container.binds import bind_list

# Steps that run inside the image, and whether each uses GPUs when cluster.device=cuda.
STEP_USES_GPU: Dict[str, bool] = {"prepare": False, "train": True, "consolidate": False, "evaluate": False}

# Host variables that cross into the image: Slurm, rendezvous, launchers, Accelerate, NCCL, torch, CUDA.
PASS_ENV_PREFIXES = (
    "SLURM_", "MASTER_", "PET_", "TORCHELASTIC_", "ACCELERATE_", "FSDP_", "NCCL_", "TORCH_", "CUDA_",
)
PASS_ENV_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
# pyxis leaks the whole task environment; these would make the image run the host's Python packages.
PYXIS_UNSET = (
    "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "VIRTUAL_ENV",
    "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_PRELOAD",
)


@dataclass(frozen=True)
class EnvFilter:
    """Host variables that cross into an ``apptainer exec --cleanenv`` image.

    The renderer turns this into a constant bash program that exports each
    passing variable again as ``<export_prefix><NAME>`` (which Apptainer honours
    under ``--cleanenv``) after dropping any such variable the user's shell had.
    """

    pass_prefixes: Tuple[str, ...] = PASS_ENV_PREFIXES
    pass_names: Tuple[str, ...] = PASS_ENV_NAMES
    export_prefix: str = "APPTAINERENV_"
    drop_prefixes: Tuple[str, ...] = ("APPTAINERENV_", "SINGULARITYENV_")


@dataclass(frozen=True)
class ContainerCommand:
    """What runs a step inside the image: ``[env filter] + prefix + step argv``.

    Attributes:
        env_filter: run the host environment through this first (Apptainer), or None.
        prefix: the runtime's argv (``apptainer exec ... IMAGE``) and the in-image ``env``;
            empty without a container.
    """

    env_filter: Optional[EnvFilter]
    prefix: List[str] = field(default_factory=list)


def check_step(step: str) -> None:
    """Raises ValueError for a step name no wrapper knows."""
    if step not in STEP_USES_GPU:
        raise ValueError(f"unknown container step {step!r}; expected one of {', '.join(STEP_USES_GPU)}")


def uses_gpu(cfg: WorkflowConfig, step: str) -> bool:
    """Whether ``step`` gets the GPUs (``--nv``)."""
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
    env.update(cfg.container.env)
    return dict(sorted(env.items()))


def _in_image_env(cfg: WorkflowConfig) -> List[str]:
    """``env [-u NAME...] K=V...``: run first inside the image, so explicit values win."""
    argv = ["env"]
    if cfg.container.runtime == ContainerRuntime.pyxis:
        for name in PYXIS_UNSET:
            argv += ["-u", name]
    return argv + [f"{k}={v}" for k, v in explicit_env(cfg).items()]


def container_command(cfg: WorkflowConfig, step: str) -> ContainerCommand:
    """What goes in front of a step's command for the configured runtime.

    Args:
        cfg: the validated config.
        step: ``train``, ``consolidate`` or ``evaluate``.

    Returns:
        Nothing for ``container=none``; for ``pyxis`` the in-image ``env`` prefix
        (srun's :func:`srun_container_args` carry the image); for ``apptainer`` the
        env filter and the whole ``apptainer exec`` command.

    Raises:
        ValueError: an unknown step, or a bind that cannot be parsed.
    """
    check_step(step)
    ct = cfg.container
    if ct.runtime == ContainerRuntime.none:
        return ContainerCommand(None)
    if ct.runtime == ContainerRuntime.pyxis:
        return ContainerCommand(None, _in_image_env(cfg))
    argv = ["apptainer", "exec", "--cleanenv", "--no-home"]
    if uses_gpu(cfg, step):
        argv.append("--nv")
    argv += ["--pwd", str(run_layout(cfg).root)]
    for b in bind_list(cfg):
        argv += ["--bind", b.apptainer()]
    argv += list(ct.extra_args)
    argv.append(str(ct.image))
    return ContainerCommand(EnvFilter(), argv + _in_image_env(cfg))


def pyxis_env_names(cfg: WorkflowConfig, step: str) -> List[str]:
    """Host variables whose values must override the image's under pyxis."""
    names = {"MASTER_ADDR", "MASTER_PORT", *accelerate_env(cfg), *cfg.cluster.nccl_env}
    if not uses_gpu(cfg, step):
        names.add("NVIDIA_VISIBLE_DEVICES")
    return sorted(names)


def srun_container_args(cfg: WorkflowConfig, step: str) -> List[str]:
    """srun options that run a step inside the image (pyxis); empty for other runtimes.

    Raises:
        ValueError: an unknown step, or a bind that cannot be parsed.
    """
    check_step(step)
    ct = cfg.container
    if ct.runtime != ContainerRuntime.pyxis:
        return []
    args = [
        f"--container-image={ct.image}",
        "--container-mounts=" + ",".join(b.pyxis() for b in bind_list(cfg)),
        "--no-container-mount-home",
        f"--container-workdir={run_layout(cfg).root}",
        "--container-env=" + ",".join(pyxis_env_names(cfg, step)),
    ]
    if not uses_gpu(cfg, step):
        # no GPU on a CPU step: keep the enroot NVIDIA hook from looking for a driver
        args.append("--export=ALL,NVIDIA_VISIBLE_DEVICES=void")
    return args + list(ct.extra_args)
