"""The launch as data: jobs, their options, the commands they run, how they are submitted.

:func:`fsdp_workflow.plan.spec.build_plan` fills these from a config;
:mod:`fsdp_workflow.backends.slurm.scripts` turns them into the run directory's scripts
and ``sbatch`` commands, which :mod:`fsdp_workflow.backends.slurm.submit` runs. Nothing here touches the filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fsdp_workflow.core.roles import Role
from fsdp_workflow.core.rundir import RunDir


# What each role is called in messages ("training job: 123").
NOUN: Dict[Role, str] = {Role.prepare: "data preparation", Role.train: "training", Role.consolidate: "consolidation",
                         Role.eval: "evaluation"}


def job_label(role: Role) -> str:
    """``"training job:      "``: a role's name padded for the lines that list a chain's jobs."""
    return f"{NOUN[role]} job: ".ljust(19)


class Expand(str):
    """An argument the job's shell must expand at run time (``${SLURM_NODEID:-0}``).

    Only code in this package creates these, from constants; config values are
    always plain ``str`` and are quoted by the renderer.
    """


@dataclass
class SbatchJob:
    """One job of the chain: header options (no paths), path options, and what it runs.

    Each command is held once, as any machine runs it (wrapped for the container):
    the local launcher runs ``argv`` itself, and the batch script runs it as
    :meth:`as_step` makes it, behind ``step_prefix``.

    Attributes:
        role: the job's :class:`~fsdp_workflow.core.roles.Role`; also the log file's prefix.
        script: the batch script's file name in the run directory.
        options: ``#SBATCH`` options, ``("nodes", "2")``; value None for flags.
        path_options: ``--output``: passed on the sbatch command line, quoted, because
            Slurm's header parser has no quoting for spaces or quotes.
        argv: the job's command.
        step_prefix: what makes a command a step of the batch job (``srun ...``); empty:
            the batch shell runs it.
        after: the role this job waits for (``--dependency=afterok``), or None.
        before_argvs: commands run before ``argv``, each of which must succeed (the EMA's consolidation).
        after_argvs: commands run once ``argv`` succeeded (the consolidation job's model card).
    """

    role: Role
    script: str
    options: List[Tuple[str, Optional[str]]]
    path_options: Dict[str, str]
    argv: List[str] = field(default_factory=list)
    step_prefix: List[str] = field(default_factory=list)
    after: Optional[Role] = None
    before_argvs: List[List[str]] = field(default_factory=list)
    after_argvs: List[List[str]] = field(default_factory=list)

    def as_step(self, argv: List[str]) -> List[str]:
        """``argv`` as the batch script runs it: behind :attr:`step_prefix`."""
        return [*self.step_prefix, *argv]


@dataclass
class LaunchPlan:
    """Everything the run directory's scripts do, as values and argument lists.

    Attributes:
        layout: the run directory's paths (``cluster.log_dir``, ``consolidate.output_dir`` applied).
        node_script_argv: the per-node launcher (torchrun or accelerate launch), wrapped for the container.
        chain: the jobs, in order (prepare, train afterok, consolidate afterok): ``submit.sh``
            submits them and the local launcher runs them. Data preparation is absent for
            synthetic data, consolidation when it is off.
        eval_job: the per-checkpoint evaluation job, submitted by ``post_checkpoint.sh``.
        shutdown_timeout_s: torchrun's wait for the ranks after SIGTERM before SIGKILL.
        code_dir: ``RUN_DIR/code`` when ``cluster.code_snapshot`` is on (:mod:`fsdp_workflow.plan.snapshot`).
        config_sha256: the hash of the ``config.yaml`` planning writes; each job refuses another file.
        preflight_argv: the training job's preflight step (``srun`` one task per node running
            ``python -m fsdp_workflow.preflight``), wrapped for the container; empty with ``cluster.preflight=false``.
        python_dir: where the interpreter that planned lives; jobs run it by absolute path and find
            ``torchrun``/``accelerate`` beside it, so a fresh login shell submits the same environment.
    """

    layout: RunDir
    node_script_argv: List[str]
    chain: List[SbatchJob]
    max_requeues: int
    master_port_base: int
    port_range: int
    nnodes: int
    nccl_env: Dict[str, str]
    eval_job: Optional[SbatchJob] = None
    shutdown_timeout_s: int = 30
    modules: List[str] = field(default_factory=list)  # `module load` in every job, before the step
    env_script: Optional[str] = None  # sourced in every job, before the step
    code_dir: Optional[Path] = None  # the code snapshot, first on every job's PYTHONPATH (None: opted out)
    config_sha256: str = ""  # sha256 of config.yaml as planned: every job checks it first (core.config_hash)
    python_dir: Optional[str] = None  # the planning interpreter's directory, first on PATH (None: in an image)
    planner_python: str = "python"  # the interpreter that planned: submit.sh asks it whether the run is complete
    max_steps: int = 0  # train.max_steps: submit.sh tells a finished run from one to continue
    preflight_argv: List[str] = field(default_factory=list)  # run before the training step (cluster.preflight)

    @property
    def run_dir(self) -> Path:
        return self.layout.root

    def job(self, role: Role) -> Optional[SbatchJob]:
        """The chain's job of ``role``, if the plan has one."""
        return next((j for j in self.chain if j.role == role), None)

    @property
    def train(self) -> SbatchJob:
        job = self.job(Role.train)
        assert job is not None, "every plan trains"
        return job

    @property
    def consolidate(self) -> Optional[SbatchJob]:
        return self.job(Role.consolidate)
