"""The one module that turns a :class:`LaunchPlan` into shell text.

Every value that came from the config is quoted with :func:`shlex.quote`;
only :class:`~fsdp_workflow.plan.spec.Expand` arguments, which this package
builds from constants, are left for the job's shell to expand. Path-valued
sbatch options (``--output``) go on the sbatch command line in ``submit.sh``
rather than in ``#SBATCH`` headers, because Slurm's header parser has no
quoting for spaces, quotes or newlines.
"""

from __future__ import annotations

import shlex
from typing import Iterable, List

from fsdp_workflow.exit_codes import EXIT_REQUEUE
from fsdp_workflow.plan.spec import (
    CONSOLIDATE_SBATCH,
    JOBS_FILE,
    LAUNCH_ENV_FILE,
    REQUEUE_MARKER,
    TRAIN_NODE_SCRIPT,
    TRAIN_SBATCH,
    Expand,
    LaunchPlan,
    SbatchJob,
)

HEADER = "# Written by fsdp_workflow; the run directory's config.yaml says what it runs."


def shell_word(arg: str) -> str:
    """Quote one argument; runtime expansions are double-quoted so they still expand."""
    if isinstance(arg, Expand):
        return f'"{arg}"'
    return shlex.quote(str(arg))


def shell_join(argv: Iterable[str]) -> str:
    return " ".join(shell_word(a) for a in argv)


def _exports(env: dict) -> List[str]:
    return [f"export {key}={shlex.quote(value)}" for key, value in env.items()]


def _sbatch_header(job: SbatchJob) -> List[str]:
    lines = ["#!/bin/bash"]
    for key, value in job.options:
        lines.append(f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={value}")
    return lines


def _run_dir_lines(plan: LaunchPlan) -> List[str]:
    return [f"RUN_DIR={shlex.quote(str(plan.run_dir))}"]


def render_train_node(plan: LaunchPlan) -> str:
    """What one task per node runs: load launch.env, then start this node's ranks."""
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Runs once per node (srun --ntasks-per-node=1). SLURM_NODEID is read here, in the",
        "# task, so every node gets its own rank; the batch shell would expand it to 0.",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        'set -a; . "$RUN_DIR/' + LAUNCH_ENV_FILE + '"; set +a',
        ': "${MASTER_ADDR:?MASTER_ADDR is set by train.sbatch (first host of the allocation)}"',
        ': "${MASTER_PORT:?MASTER_PORT is set by train.sbatch (derived from the job id)}"',
        'echo "[fsdp_workflow] host $(hostname) node_rank ${SLURM_NODEID:-0} of '
        f'{plan.nnodes} master $MASTER_ADDR:$MASTER_PORT" >&2',
        "# The launcher must outlive the preemption signal; the ranks install their own handler.",
        "trap '' USR2",
        "exec " + shell_join(plan.node_script_argv),
        "",
    ]
    return "\n".join(lines)


def render_train_sbatch(plan: LaunchPlan) -> str:
    job = plan.train
    lines = _sbatch_header(job) + [
        HEADER,
        "set -uo pipefail",
        *_run_dir_lines(plan),
        f"MAX_REQUEUES={plan.max_requeues}",
        *_exports(job.exports),
        '# Rendezvous on the first host of the allocation, never localhost.',
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# A port derived from the job id, below the ephemeral range (32768+).",
        f"MASTER_PORT=$(( {plan.master_port_base} + SLURM_JOB_ID % {plan.port_range} ))",
        "export MASTER_ADDR MASTER_PORT",
        'echo "[fsdp_workflow] train job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}/'
        '$MAX_REQUEUES nodes $SLURM_JOB_NODELIST master $MASTER_ADDR:$MASTER_PORT" >&2',
        f'rm -f "$RUN_DIR/{REQUEUE_MARKER}"',
        shell_join(job.step_argv),
        "rc=$?",
        f'if [ "$rc" -ne 0 ] && [ -f "$RUN_DIR/{REQUEUE_MARKER}" ]; then',
        '  if [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then',
        '    echo "[fsdp_workflow] checkpoint saved on a signal: requeueing job $SLURM_JOB_ID" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        f"    exit {EXIT_REQUEUE}",
        "  fi",
        '  echo "[fsdp_workflow] preempted again but out of requeues ($MAX_REQUEUES): failing" >&2',
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def render_consolidate_sbatch(plan: LaunchPlan) -> str:
    assert plan.consolidate is not None
    lines = _sbatch_header(plan.consolidate) + [
        HEADER,
        "# Starts only after the training job succeeded (afterok, kill-on-invalid-dep).",
        "set -euo pipefail",
        "exec " + shell_join(plan.consolidate.step_argv),
        "",
    ]
    return "\n".join(lines)


def sbatch_argv(job: SbatchJob, script: str) -> List[str]:
    argv = ["sbatch", "--parsable"]
    for key, value in sorted(job.path_options.items()):
        argv.append(f"--{key}={value}")
    return argv + [script]


def render_submit(plan: LaunchPlan) -> str:
    """A plain-sbatch chain: training, then consolidation afterok. No Python on the login node."""
    train_cmd = sbatch_argv(plan.train, str(plan.run_dir / TRAIN_SBATCH))
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Submit the chain without Python: bash submit.sh",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        'mkdir -p "$RUN_DIR/logs"',
        "train_id=$(" + shell_join(train_cmd) + ")",
        'train_id=${train_id%%;*}',
        f'echo "train $train_id" >> "$RUN_DIR/{JOBS_FILE}"',
        'echo "training job:      $train_id"',
    ]
    if plan.consolidate is not None:
        cons_cmd = sbatch_argv(plan.consolidate, str(plan.run_dir / CONSOLIDATE_SBATCH))
        cons_cmd = cons_cmd[:2] + [Expand("--dependency=afterok:${train_id}"), "--kill-on-invalid-dep=yes"] + cons_cmd[2:]
        lines += [
            "cons_id=$(" + shell_join(cons_cmd) + ")",
            'cons_id=${cons_id%%;*}',
            f'echo "consolidate $cons_id" >> "$RUN_DIR/{JOBS_FILE}"',
            'echo "consolidation job: $cons_id (afterok:$train_id)"',
        ]
    lines += [
        'echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"',
        "",
    ]
    return "\n".join(lines)


def render_all(plan: LaunchPlan) -> dict:
    """Every script of the run directory, by file name."""
    out = {
        TRAIN_NODE_SCRIPT: render_train_node(plan),
        TRAIN_SBATCH: render_train_sbatch(plan),
        "submit.sh": render_submit(plan),
    }
    if plan.consolidate is not None:
        out[CONSOLIDATE_SBATCH] = render_consolidate_sbatch(plan)
    return out
