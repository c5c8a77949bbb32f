"""Build the launch as data from a validated config (:func:`build_plan`).

A :class:`~fsdp_workflow.plan.jobs.LaunchPlan` holds everything the job scripts
do, as plain values and argument lists: ``#SBATCH`` options, exported variables
and the commands each step runs, every step wrapped for ``cfg.container``.
The run's backend renders it into text (:mod:`fsdp_workflow.backends.slurm.scripts`), and both submission routes
(``submit.sh`` and ``python -m fsdp_workflow``) submit those same scripts.
Building it never touches the filesystem, so a dry run and a real submission
cannot diverge.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from fsdp_workflow.config.load import to_yaml
from fsdp_workflow.config.model_dir import output_dtype
from fsdp_workflow.config.rules_env import SAFE_SBATCH_VALUE  # validated before planning
from fsdp_workflow.config.schema import (
    DataSource,
    Device,
    Launcher,
    RankStart,
    WorkflowConfig,
    rank_start,
    run_layout,
    world_size,
)
from fsdp_workflow.container import container_command, in_image, srun_container_args
from fsdp_workflow.core.config_hash import config_sha256
from fsdp_workflow.core.roles import Role
from fsdp_workflow.core.rundir import (
    CONSOLIDATE_SBATCH,
    EMA_KEY,
    EVAL_SBATCH,
    MODEL_KEY,
    PREPARE_SBATCH,
    SWEEP_FILE,
    TRAIN_NODE_SCRIPT,
    TRAIN_SBATCH,
    RunDir,
)
from fsdp_workflow.plan.jobs import Expand, LaunchPlan, SbatchJob
from fsdp_workflow.plan.render import wrapped_argv

Options = List[Tuple[str, Optional[str]]]


def wrap_argv(cfg: WorkflowConfig, argv: List[str], step: Role) -> List[str]:
    """A step's command, run inside ``cfg.container``'s image (unchanged without one).

    Without an image, ``python`` becomes the absolute path of the interpreter that
    planned: a job submitted from a shell without the venv runs the same Python.

    Raises:
        ValueError: an unknown step, or a bind that cannot be parsed.
    """
    if not in_image(cfg) and argv[:1] == ["python"]:
        argv = [sys.executable, *argv[1:]]
    return wrapped_argv(container_command(cfg, step), argv)


def sweep_point(run_dir: Path) -> Optional[int]:
    """The point number of a run directory in a ``-m`` sweep (its parent's ``sweep.json``), else None.

    Read so that each point's jobs get a name of their own (``squeue`` tells them apart);
    the index is written before the first point plans (:mod:`fsdp_workflow.launch.sweep`).
    """
    try:
        index = json.loads((run_dir.parent / SWEEP_FILE).read_text())
        points = index.get("points") if isinstance(index, dict) else None
    except (OSError, ValueError):
        return None
    for p in points if isinstance(points, list) else []:
        if isinstance(p, dict) and isinstance(p.get("num"), int) and \
                os.path.abspath(str(p.get("run_dir"))) == str(run_dir):
            return p["num"]
    return None


def job_name(cfg: WorkflowConfig, role: Role) -> str:
    """``NAME-ROLE``, or ``NAME-N-ROLE`` for point N of a sweep (every point's jobs distinct in squeue)."""
    num = sweep_point(run_layout(cfg).root)
    return _sbatch_value("name", f"{cfg.name}-{role}" if num is None else f"{cfg.name}-{num}-{role}")


def console_script(cfg: WorkflowConfig, command: List[str], module: str) -> List[str]:
    """``command`` (a console script and its subcommand: ``torchrun``, ``accelerate launch``) as the job will find it.

    Outside an image the job runs the planning interpreter, and its scripts are found
    beside it (``PATH`` starts there). A venv made with ``--system-site-packages`` has
    the interpreter but not the system's ``torchrun``: the job would end with "command
    not found" (127) after its time in the queue. Then the module runs under the
    planning interpreter instead (``python -m``, made absolute by :func:`wrap_argv`).
    In an image, the image's own script is used.
    """
    if in_image(cfg) or beside_interpreter(command[0]):
        return command
    return ["python", "-m", module]


def beside_interpreter(name: str) -> bool:
    """Whether the planning interpreter's directory holds an executable ``name``."""
    return os.access(os.path.join(os.path.dirname(sys.executable), name), os.X_OK)


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
            *console_script(cfg, ["accelerate", "launch"], "accelerate.commands.launch"),
            f"--num_machines={c.nodes}",
            f"--num_processes={world_size(cfg)}",
            Expand("--machine_rank=${SLURM_NODEID:-0}"),
            Expand("--main_process_ip=${MASTER_ADDR}"),
            Expand("--main_process_port=${MASTER_PORT}"),
            f"--rdzv_conf=timeout={c.rdzv_timeout_s}",
            "-m", "fsdp_workflow.train", str(run_dir),
        ]
    # cluster.rank_start: torchrun's exec'd ranks, or the same agent forking them after one import.
    node = (["python", "-m", "fsdp_workflow.train.node"] if rank_start(cfg) == RankStart.preloaded
            else console_script(cfg, ["torchrun"], "torch.distributed.run"))
    return [
        *node,
        *rendezvous,
        f"--nproc_per_node={c.processes_per_node}",
        "--max_restarts=0",
        "-m", "fsdp_workflow.train", str(run_dir),
    ]


def consolidate_argv(cfg: WorkflowConfig, layout: RunDir, ema: bool = False) -> List[str]:
    """The consolidation command, shared by the local launcher and consolidate.sbatch.

    With ``train.ema_decay`` a checkpoint holds two models, under the key roots
    ``model`` and ``ema`` (:mod:`fsdp_workflow.train.ema`): each command then names
    its subtree. The EMA's command (``ema=True``: ``hf_model_ema/``) runs first and
    never removes the shards; the model's runs last (``--remove-sharded`` if asked).

    Args:
        cfg: a validated config.
        layout: its run directory.
        ema: the command writing the EMA's model; ``[]`` when the run keeps no EMA.
    """
    has_ema = cfg.train.ema_decay is not None
    if ema and not has_ema:
        return []
    argv = [
        "python", "-m", "fsdp_workflow.consolidate",
        str(layout.checkpoints), str(layout.hf_model_ema if ema else layout.hf_model),
        "--max-shard-size", cfg.consolidate.max_shard_size,
    ]
    if has_ema:
        argv += ["--subtree", EMA_KEY if ema else MODEL_KEY]
    dtype = output_dtype(cfg)  # auto: the base model's dtype
    if dtype is not None:
        argv += ["--dtype", dtype]
    if not cfg.consolidate.verify:
        argv.append("--no-verify")
    if cfg.consolidate.remove_sharded and not ema:
        argv.append("--remove-sharded")
    if cfg.consolidate.allow_nonfinite:
        argv.append("--allow-nonfinite")
    if cfg.consolidate.output_dir is None:  # RUN_DIR's own hf_model/: a rerun of the run replaces its model
        argv.append("--overwrite")
    return argv


def card_argv(cfg: WorkflowConfig, layout: RunDir) -> List[str]:
    """The report stage's model card for the consolidated model(s), run after their consolidation.

    The run directory is passed, not guessed from where the checkpoints sit: the card reads
    the run's record (config, metrics, evals, data sources) through it.

    Args:
        cfg: a validated config.
        layout: its run directory.
    """
    models = ([str(layout.hf_model_ema)] if cfg.train.ema_decay is not None else []) + [str(layout.hf_model)]
    return ["python", "-m", "fsdp_workflow.report.card", *models, "--run-dir", str(layout.root)]


def _sbatch_value(key: str, value: object) -> str:
    text = str(value)
    if not SAFE_SBATCH_VALUE.match(text):
        raise ValueError(
            f"cluster.{key}={text!r}: #SBATCH values must be one token without spaces, quotes "
            "or newlines. Fix the value, or pass it through cluster.additional_parameters."
        )
    return text


def _common_options(cfg: WorkflowConfig, partition: Optional[str]) -> Options:
    c = cfg.cluster
    opts: Options = []
    for key, value in (("partition", partition), ("account", c.account), ("qos", c.qos)):
        if value:
            opts.append((key, _sbatch_value(key, value)))
    return opts


def _cpu_job_options(cfg: WorkflowConfig, role: Role) -> Options:
    """One task on one node with the consolidation resources (consolidation and evaluation jobs)."""
    c = cfg.cluster
    opts = [("job-name", job_name(cfg, role))]
    opts += _common_options(cfg, c.consolidate_partition or c.partition)
    return opts + [
        ("nodes", "1"),
        ("ntasks", "1"),
        ("cpus-per-task", str(c.consolidate_cpus)),
        ("mem", f"{c.consolidate_mem_gb}G"),
        ("time", str(c.consolidate_time_min)),
    ]


def _train_options(cfg: WorkflowConfig) -> Options:
    """The training job's ``#SBATCH`` options: resources, signal, requeue, extra parameters."""
    c = cfg.cluster
    gpus = c.gpus_per_node if c.gpus_per_node is not None else (
        c.processes_per_node if c.device == Device.cuda else 0)
    opts = [("job-name", job_name(cfg, Role.train))]
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
    return opts


def _train_job(cfg: WorkflowConfig, layout: RunDir) -> SbatchJob:
    """One task per node runs ``train_node.sh``; a rank that dies fails the whole step."""
    n = cfg.cluster.nodes
    return SbatchJob(
        role=Role.train, script=TRAIN_SBATCH, options=_train_options(cfg),
        path_options={"output": str(layout.log_pattern(Role.train))},
        argv=["bash", str(layout.script(TRAIN_NODE_SCRIPT))],
        step_prefix=["srun", "--kill-on-bad-exit=1", f"--nodes={n}", "--ntasks-per-node=1",
                     *srun_container_args(cfg, Role.train)],
    )


def preflight_argv(cfg: WorkflowConfig, layout: RunDir) -> List[str]:
    """The training job's preflight step: one task per node, in the training's image (``cluster.preflight``).

    No ``--kill-on-bad-exit``: every node gets to say what it found (:mod:`fsdp_workflow.preflight`).
    """
    c = cfg.cluster
    if not c.preflight:
        return []
    argv = ["python", "-m", "fsdp_workflow.preflight", str(layout.root), f"--nodes={c.nodes}",
            f"--processes-per-node={c.processes_per_node}", f"--device={c.device.value}"]
    return ["srun", f"--nodes={c.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            *srun_container_args(cfg, Role.train), *wrap_argv(cfg, argv, Role.train)]


def _cpu_job(cfg: WorkflowConfig, layout: RunDir, role: Role, script: str, argv: List[str],
             after: Optional[Role] = None, before: Optional[List[List[str]]] = None,
             then: Optional[List[List[str]]] = None) -> SbatchJob:
    """A one-task CPU job (data preparation, consolidation, evaluation) with the ``consolidate_*`` resources.

    ``before``: commands the job runs first, each wrapped like ``argv`` (the EMA's consolidation);
    ``then``: commands it runs once ``argv`` succeeded (the model card).
    """
    attach = srun_container_args(cfg, role)  # the container step is the role
    return SbatchJob(
        role=role, script=script, options=_cpu_job_options(cfg, role),
        path_options={"output": str(layout.log_pattern(role))},
        argv=argv,
        # a runtime that attaches the image to an srun step (pyxis) needs one; otherwise run in the batch shell
        step_prefix=["srun", "--ntasks=1", *attach] if attach else [],
        after=after,
        before_argvs=list(before or []),
        after_argvs=list(then or []),
    )


def build_plan(cfg: WorkflowConfig) -> LaunchPlan:
    """Build the whole launch as data, each step wrapped for ``cfg.container``.

    Args:
        cfg: a validated config.

    Raises:
        ValueError: a value no script can carry (named by key).
    """
    c = cfg.cluster
    layout = run_layout(cfg)
    chain: List[SbatchJob] = []
    if cfg.data.source != DataSource.synthetic:
        # Tokenise once, on CPU, before the GPUs are allocated: the head of the chain.
        prep_argv = wrap_argv(cfg, ["python", "-m", "fsdp_workflow.data.prepare", str(layout.root)], Role.prepare)
        chain.append(_cpu_job(cfg, layout, Role.prepare, PREPARE_SBATCH, prep_argv))
    train = _train_job(cfg, layout)
    train.after = chain[-1].role if chain else None
    chain.append(train)
    if cfg.consolidate.enabled:
        cons_argv = wrap_argv(cfg, consolidate_argv(cfg, layout), Role.consolidate)
        ema_argv = wrap_argv(cfg, consolidate_argv(cfg, layout, ema=True), Role.consolidate) \
            if cfg.train.ema_decay is not None else []
        card = wrap_argv(cfg, card_argv(cfg, layout), Role.consolidate)
        chain.append(_cpu_job(cfg, layout, Role.consolidate, CONSOLIDATE_SBATCH, cons_argv, after=Role.train,
                              before=[ema_argv] if ema_argv else None, then=[card]))
    eval_job = None
    if cfg.consolidate.every_checkpoint:
        eval_argv = wrap_argv(cfg, ["python", "-m", "fsdp_workflow.evaluate", str(layout.root), Expand("${STEP}")],
                              Role.eval)
        eval_job = _cpu_job(cfg, layout, Role.eval, EVAL_SBATCH, eval_argv)
    return LaunchPlan(
        layout=layout,
        node_script_argv=wrap_argv(cfg, launcher_argv(cfg, layout.root), Role.train),
        chain=chain,
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
        code_dir=layout.code if c.code_snapshot else None,
        # the bytes write_run_dir writes to config.yaml (plan.run_dir): every job checks them first
        config_sha256=config_sha256(to_yaml(cfg)),
        python_dir=None if in_image(cfg) else os.path.dirname(sys.executable),
        planner_python=sys.executable,  # on the login node, where submit.sh runs, even when the jobs use an image
        max_steps=cfg.train.max_steps,
        preflight_argv=preflight_argv(cfg, layout),
    )
