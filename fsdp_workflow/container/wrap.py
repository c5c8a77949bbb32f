"""Run a step's argument list inside the image: Apptainer's argv, pyxis's srun options.

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

Only argument lists here; :mod:`fsdp_workflow.plan.render` quotes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from fsdp_workflow.config.schema import ContainerRuntime, Device, WorkflowConfig
from fsdp_workflow.container.binds import bind_list

# Steps that run inside the image, and whether each uses GPUs when cluster.device=cuda.
STEP_USES_GPU: Dict[str, bool] = {"train": True, "consolidate": False, "evaluate": False}

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
CACHE_SUBDIR = ".cache"

# Constant program (no config value is ever interpolated): filter the host environment
# into APPTAINERENV_* for `apptainer exec --cleanenv`, then exec the rest of argv.
_PASS_PATTERNS = "|".join([f"{p}*" for p in PASS_ENV_PREFIXES] + list(PASS_ENV_NAMES))
PASS_ENV_PROGRAM = (
    'for n in $(compgen -e); do case "$n" in '
    'APPTAINERENV_*|SINGULARITYENV_*) unset "$n";; '
    f'{_PASS_PATTERNS}) export "APPTAINERENV_$n=${{!n}}";; '
    'esac; done; exec "$@"'
)
PASS_ENV_ARGV0 = "fsdp_workflow-container-env"  # $0 of the program, shown by ps


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
    cache = Path(cfg.run_dir).absolute() / CACHE_SUBDIR
    env = {
        "PYTHONNOUSERSITE": "1",  # ~/.local must never shadow the image's packages
        "HF_HUB_OFFLINE": "1",  # models are local directories; compute nodes may have no network
        "XDG_CACHE_HOME": str(cache),  # home is not mounted: HF and torch caches live in the run dir
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    env.update(cfg.container.env)
    return dict(sorted(env.items()))


def _in_image_env(cfg: WorkflowConfig) -> List[str]:
    """``env [-u NAME...] K=V...``: run first inside the image, so explicit values win."""
    argv = ["env"]
    if cfg.container.runtime == ContainerRuntime.pyxis:
        for name in PYXIS_UNSET:
            argv += ["-u", name]
    return argv + [f"{k}={v}" for k, v in explicit_env(cfg).items()]


def wrap_argv(cfg: WorkflowConfig, argv: List[str], step: str) -> List[str]:
    """Wrap a step's command for the configured runtime.

    Args:
        cfg: the validated config.
        argv: the step's command on the host (``torchrun ...``, ``python -m ...``).
        step: ``train``, ``consolidate`` or ``evaluate``.

    Returns:
        ``argv`` unchanged for ``container=none``; for ``pyxis`` the in-image
        ``env`` prefix (srun's :func:`srun_container_args` carry the image);
        for ``apptainer`` the whole ``apptainer exec`` command.

    Raises:
        ValueError: an unknown step, or a bind that cannot be parsed.
    """
    check_step(step)
    ct = cfg.container
    if ct.runtime == ContainerRuntime.none:
        return list(argv)
    if ct.runtime == ContainerRuntime.pyxis:
        return _in_image_env(cfg) + list(argv)
    wrapped = ["bash", "-c", PASS_ENV_PROGRAM, PASS_ENV_ARGV0, "apptainer", "exec", "--cleanenv", "--no-home"]
    if uses_gpu(cfg, step):
        wrapped.append("--nv")
    wrapped += ["--pwd", str(Path(cfg.run_dir).absolute())]
    for b in bind_list(cfg):
        wrapped += ["--bind", b.apptainer()]
    wrapped += list(ct.extra_args)
    wrapped.append(str(ct.image))
    return wrapped + _in_image_env(cfg) + list(argv)


def pyxis_env_names(cfg: WorkflowConfig, step: str) -> List[str]:
    """Host variables whose values must override the image's under pyxis."""
    from fsdp_workflow.config.accelerate_env import accelerate_env

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
        f"--container-workdir={Path(cfg.run_dir).absolute()}",
        "--container-env=" + ",".join(pyxis_env_names(cfg, step)),
    ]
    if not uses_gpu(cfg, step):
        # no GPU on a CPU step: keep the enroot NVIDIA hook from looking for a driver
        args.append("--export=ALL,NVIDIA_VISIBLE_DEVICES=void")
    return args + list(ct.extra_args)
