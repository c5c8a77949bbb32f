"""The launch as data.

A :class:`LaunchPlan` holds everything the job scripts do, as plain values and
argument lists: ``#SBATCH`` options, exported variables and the commands each
step runs. :mod:`fsdp_workflow.plan.render` turns it into text; the Slurm
launcher submits the same data through submitit. Building it never touches
the filesystem, so a dry run and a real submission cannot diverge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fsdp_workflow.config.rules_env import SAFE_SBATCH_VALUE  # validated before planning
from fsdp_workflow.config.schema import (
    ClusterKind,
    Device,
    Launcher,
    OutputDtype,
    WorkflowConfig,
    world_size,
)

# Files a run directory holds; every stage refers to them through these names.
CONFIG_FILE = "config.yaml"
LAUNCH_ENV_FILE = "launch.env"
TRAIN_SBATCH = "train.sbatch"
TRAIN_NODE_SCRIPT = "train_node.sh"
CONSOLIDATE_SBATCH = "consolidate.sbatch"
SUBMIT_SCRIPT = "submit.sh"
EVAL_SBATCH = "eval.sbatch"  # consolidate + evaluate one checkpoint (consolidate.every_checkpoint)
SUBMIT_EVAL_SCRIPT = "submit_eval.sh"  # bash submit_eval.sh STEP: what rank 0 runs per checkpoint
EVALS_FILE = "evals.jsonl"  # one JSON line per evaluated checkpoint, with its step
JOBS_FILE = "jobs.txt"  # "<role> <job id>" lines appended at each submission
LOG_DIR = "logs"

class Expand(str):
    """An argument the job's shell must expand at run time (``${SLURM_NODEID:-0}``).

    Only code in this package creates these, from constants; config values are
    always plain ``str`` and are quoted by the renderer.
    """




@dataclass
class SbatchJob:
    """One Slurm job: header options (no paths), path options, and what it runs."""

    role: str  # "train" or "consolidate"
    options: List[Tuple[str, Optional[str]]]  # ("nodes", "2"); value None for flags
    path_options: Dict[str, str]  # output/error: passed on the sbatch command line, quoted
    step_argv: List[str] = field(default_factory=list)  # what the job's step runs


@dataclass
class LaunchPlan:
    run_dir: Path
    node_script_argv: List[str]  # torchrun (or accelerate launch) for one node, wrapped
    consolidate_argv: List[str]  # python -m fsdp_workflow.consolidate ..., wrapped
    train: SbatchJob
    consolidate: Optional[SbatchJob]
    max_requeues: int
    master_port_base: int
    port_range: int
    nnodes: int
    nccl_env: Dict[str, str]
    eval_job: Optional[SbatchJob] = None  # per-checkpoint evaluation (consolidate.every_checkpoint)
    shutdown_timeout_s: int = 30  # torchrun's wait for ranks after SIGTERM before SIGKILL
    modules: List[str] = field(default_factory=list)  # `module load` in every job, before the step
    env_script: Optional[str] = None  # sourced in every job, before the step


def consolidated_dir(cfg: WorkflowConfig) -> Path:
    return Path(cfg.consolidate.output_dir or Path(cfg.run_dir) / "hf_model")


def launcher_argv(cfg: WorkflowConfig, run_dir: Path) -> List[str]:
    """The per-node launcher. ``$SLURM_NODEID``/``$MASTER_*`` are expanded in the task, not the batch shell."""
    c = cfg.cluster
    rendezvous = [
        f"--nnodes={c.nodes}",
        Expand("--node_rank=${SLURM_NODEID:-0}"),
        Expand("--master_addr=${MASTER_ADDR}"),
        Expand("--master_port=${MASTER_PORT}"),
        # The static rendezvous store's timeout; the ranks' process group gets the same one.
        f"--rdzv_conf=timeout={c.rdzv_timeout_s}",
    ]
    if c.launcher == Launcher.accelerate:
        # accelerate launch drops FSDP for one process with its plain launcher; it is
        # only offered for multi-process runs (validated), and reads launch.env itself.
        return [
            "accelerate", "launch",
            f"--num_machines={c.nodes}",
            f"--num_processes={world_size(cfg)}",
            Expand("--machine_rank=${SLURM_NODEID:-0}"),
            Expand("--main_process_ip=${MASTER_ADDR}"),
            Expand("--main_process_port=${MASTER_PORT}"),
            f"--rdzv_conf=timeout={c.rdzv_timeout_s}",
            "-m", "fsdp_workflow.train", str(run_dir),
        ]
    return [
        "torchrun",
        *rendezvous,
        f"--nproc_per_node={c.processes_per_node}",
        "--max_restarts=0",
        "-m", "fsdp_workflow.train", str(run_dir),
    ]


def consolidate_argv(cfg: WorkflowConfig, run_dir: Path) -> List[str]:
    """The consolidation command, shared by the local launcher and consolidate.sbatch."""
    argv = [
        "python", "-m", "fsdp_workflow.consolidate",
        str(run_dir / "checkpoints"), str(consolidated_dir(cfg)),
        "--max-shard-size", cfg.consolidate.max_shard_size,
    ]
    if cfg.consolidate.dtype != OutputDtype.keep:
        argv += ["--dtype", cfg.consolidate.dtype.value]
    if not cfg.consolidate.verify:
        argv.append("--no-verify")
    if cfg.consolidate.remove_sharded:
        argv.append("--remove-sharded")
    return argv


def _sbatch_value(key: str, value: object) -> str:
    text = str(value)
    if not SAFE_SBATCH_VALUE.match(text):
        raise ValueError(
            f"cluster.{key}={text!r}: #SBATCH values must be one token without spaces, quotes "
            "or newlines. Fix the value, or pass it through cluster.additional_parameters."
        )
    return text


def _common_options(cfg: WorkflowConfig, partition: Optional[str]) -> List[Tuple[str, Optional[str]]]:
    c = cfg.cluster
    opts: List[Tuple[str, Optional[str]]] = []
    for key, value in (("partition", partition), ("account", c.account), ("qos", c.qos)):
        if value:
            opts.append((key, _sbatch_value(key, value)))
    return opts


def _cpu_job_options(cfg: WorkflowConfig, role: str) -> List[Tuple[str, Optional[str]]]:
    """One task on one node with the consolidation resources (consolidation and evaluation jobs)."""
    c = cfg.cluster
    opts = [("job-name", _sbatch_value("name", f"{cfg.name}-{role}"))]
    opts += _common_options(cfg, c.consolidate_partition or c.partition)
    return opts + [
        ("nodes", "1"),
        ("ntasks", "1"),
        ("cpus-per-task", str(c.consolidate_cpus)),
        ("mem", f"{c.consolidate_mem_gb}G"),
        ("time", str(c.consolidate_time_min)),
    ]


def build_plan(cfg: WorkflowConfig) -> LaunchPlan:
    """Build the whole launch as data, each step wrapped for ``cfg.container``.

    Args:
        cfg: a validated config.
    """
    from fsdp_workflow.plan.container import srun_container_args, wrap_argv

    def wrap(argv: List[str], step: str) -> List[str]:
        return wrap_argv(cfg, argv, step)
    c = cfg.cluster
    run_dir = Path(cfg.run_dir).absolute()
    log_dir = Path(c.log_dir).absolute() if c.log_dir else run_dir / LOG_DIR
    gpus = c.gpus_per_node if c.gpus_per_node is not None else (
        c.processes_per_node if c.device == Device.cuda else 0)

    opts = [("job-name", _sbatch_value("name", f"{cfg.name}-train"))]
    opts += _common_options(cfg, c.partition)
    opts += [
        ("nodes", str(c.nodes)),
        ("ntasks-per-node", "1"),
        ("cpus-per-task", str(c.cpus_per_task)),
        ("time", str(c.time_min)),
    ]
    if gpus:
        opts.append(("gpus-per-node", str(gpus)))
    if c.mem_gb is not None:
        opts.append(("mem", f"{c.mem_gb}G"))
    if c.constraint:
        opts.append(("constraint", _sbatch_value("constraint", c.constraint)))
    if c.exclusive:
        opts.append(("exclusive", None))
    opts += [
        # SIGUSR2 reaches every process of the step; ranks checkpoint, torchrun ignores it.
        ("signal", f"USR2@{c.signal_delay_s}"),
        ("requeue", None),
        ("open-mode", "append"),
    ]
    for key, value in sorted(c.additional_parameters.items()):
        opts.append((_sbatch_value("additional_parameters", key), _sbatch_value(f"additional_parameters.{key}", value)))

    node_argv = wrap(launcher_argv(cfg, run_dir), "train")
    train = SbatchJob(
        role="train",
        options=opts,
        path_options={"output": str(log_dir / "train-%j.out")},
        step_argv=["srun", "--kill-on-bad-exit=1", f"--nodes={c.nodes}", "--ntasks-per-node=1",
                   *srun_container_args(cfg, "train"), "bash", str(run_dir / TRAIN_NODE_SCRIPT)],
    )

    cons_argv = wrap(consolidate_argv(cfg, run_dir), "consolidate")
    consolidate = None
    if cfg.consolidate.enabled:
        consolidate = SbatchJob(
            role="consolidate",
            options=_cpu_job_options(cfg, "consolidate"),
            path_options={"output": str(log_dir / "consolidate-%j.out")},
            # pyxis needs a step to attach the image to; otherwise run in the batch shell
            step_argv=(["srun", "--ntasks=1", *pyxis, *cons_argv] if (pyxis := srun_container_args(cfg, "consolidate"))
                       else cons_argv),
        )
    eval_job = None
    if cfg.consolidate.every_checkpoint:
        # consolidate.every_checkpoint: the consolidation job's CPU resources, per checkpoint
        eval_argv = ["python", "-m", "fsdp_workflow.launch.evaluate", str(run_dir), Expand("${STEP}")]
        eval_job = SbatchJob(
            role="eval",
            options=_cpu_job_options(cfg, "eval"),
            path_options={"output": str(log_dir / "eval-%j.out")},
            step_argv=wrap(eval_argv, "evaluate"),
        )
    return LaunchPlan(
        run_dir=run_dir,
        node_script_argv=node_argv,
        consolidate_argv=cons_argv,
        train=train,
        consolidate=consolidate,
        max_requeues=c.max_requeues,
        master_port_base=c.master_port_base,
        port_range=c.port_range,
        nnodes=c.nodes,
        nccl_env=dict(sorted(c.nccl_env.items())),
        eval_job=eval_job,
        # On SIGTERM (preemption) torchrun forwards it and SIGKILLs the ranks after this
        # long: give them the checkpoint budget the user declared, not torchrun's 30 s.
        shutdown_timeout_s=max(c.signal_delay_s, 30),
        modules=list(c.modules),
        env_script=c.env_script,
    )


def is_slurm(cfg: WorkflowConfig) -> bool:
    return cfg.cluster.kind == ClusterKind.slurm
