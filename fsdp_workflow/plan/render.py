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

from fsdp_workflow.core.exit_codes import EXIT_REQUEUE, REQUEUE_MARKER
from fsdp_workflow.plan.spec import (
    CONSOLIDATE_SBATCH,
    EVAL_SBATCH,
    JOBS_FILE,
    LAUNCH_ENV_FILE,
    SUBMIT_EVAL_SCRIPT,
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


# torchrun's default list plus Slurm's pre-timeout SIGUSR2.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


def launcher_signal_lines(plan: LaunchPlan) -> List[str]:
    """Make the launcher pass SIGUSR2/SIGTERM on to every rank and wait for their checkpoint.

    torchrun starts each rank in a session of its own, so a signal sent to torchrun
    (by the local CLI, or by Slurm where it does not signal the ranks themselves)
    reaches the ranks only if torchrun re-sends it; it then waits
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds before SIGKILL. ``PET_SIGNALS_TO_HANDLE``
    is the variable form of ``--signals-to-handle``, read by torchrun's parser and so
    by ``accelerate launch``, which runs the same agent in-process;
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` would do nothing (torchrun overwrites it).
    """
    return [
        "# torchrun starts each rank in a session of its own: a signal sent to torchrun reaches",
        "# the ranks only if torchrun re-sends it. It re-sends these, then waits this long (s)",
        "# for the ranks to checkpoint and exit before SIGKILL. accelerate launch reads the same.",
        f"export PET_SIGNALS_TO_HANDLE={FORWARDED_SIGNALS}",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={int(plan.shutdown_timeout_s)}",
        "# Until torchrun installs its handler, an early SIGUSR2 must not kill the launcher.",
        "trap '' USR2",
    ]


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
        *launcher_signal_lines(plan),
        "exec " + shell_join(plan.node_script_argv),
        "",
    ]
    return "\n".join(lines)


def rendezvous_lines(plan: LaunchPlan) -> List[str]:
    """MASTER_ADDR/MASTER_PORT in the batch shell.

    Must agree with :func:`fsdp_workflow.launch.rendezvous.rendezvous_env`, which the
    submitit path runs in Python (tests/launch compares the two).
    """
    return [
        "# Rendezvous on the first host of the allocation, never localhost.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# A port derived from the job id, below the ephemeral range (32768+).",
        f"MASTER_PORT=$(( {plan.master_port_base} + SLURM_JOB_ID % {plan.port_range} ))",
        "export MASTER_ADDR MASTER_PORT",
    ]


def site_env_lines(plan: LaunchPlan) -> List[str]:
    """``cluster.modules`` and ``cluster.env_script``, quoted: each value is one word."""
    lines = [f"module load {shlex.quote(m)}" for m in plan.modules]
    if plan.env_script:
        lines.append(f". {shlex.quote(plan.env_script)}")
    return lines


def pre_step_lines(plan: LaunchPlan) -> List[str]:
    """Before the training step: the site environment; forget a marker left by an earlier run."""
    return [
        *site_env_lines(plan),
        *_run_dir_lines(plan),
        f"MAX_REQUEUES={plan.max_requeues}",
        f'rm -f "$RUN_DIR/{REQUEUE_MARKER}"',
    ]


def requeue_lines() -> List[str]:
    """Right after the training step, in the batch shell: requeue (bounded) or pass the exit code on.

    The decision is taken here, outside the step, so ``srun --kill-on-bad-exit`` can
    never kill the process that decides. Used by train.sbatch and, as submitit's
    ``teardown``, by the submitit path.
    """
    return [
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
    ]


def render_train_sbatch(plan: LaunchPlan) -> str:
    job = plan.train
    lines = _sbatch_header(job) + [
        HEADER,
        "set -uo pipefail",
        *pre_step_lines(plan),
        *_exports(plan.nccl_env),
        *rendezvous_lines(plan),
        'echo "[fsdp_workflow] train job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}/'
        '$MAX_REQUEUES nodes $SLURM_JOB_NODELIST master $MASTER_ADDR:$MASTER_PORT" >&2',
        shell_join(job.step_argv),
        *requeue_lines(),
        "",
    ]
    return "\n".join(lines)


def _single_step_sbatch(plan: LaunchPlan, job: SbatchJob, comment: str, pre: List[str]) -> str:
    """A one-step CPU job (consolidation, evaluation): header, site environment, exec the step."""
    lines = _sbatch_header(job) + [
        HEADER,
        comment,
        "set -euo pipefail",
        *pre,
        *site_env_lines(plan),
        "exec " + shell_join(job.step_argv),
        "",
    ]
    return "\n".join(lines)


def render_consolidate_sbatch(plan: LaunchPlan) -> str:
    assert plan.consolidate is not None
    return _single_step_sbatch(
        plan, plan.consolidate, "# Starts only after the training job succeeded (afterok, kill-on-invalid-dep).", [])


def sbatch_argv(job: SbatchJob, script: str) -> List[str]:
    argv = ["sbatch", "--parsable"]
    for key, value in sorted(job.path_options.items()):
        argv.append(f"--{key}={value}")
    return argv + [script]


def render_submit(plan: LaunchPlan) -> str:
    """A plain-sbatch chain: training, then consolidation afterok. No Python on the login node.

    If the consolidation cannot be submitted, the training job is cancelled: nothing
    is left half-submitted.
    """
    train_cmd = sbatch_argv(plan.train, str(plan.run_dir / TRAIN_SBATCH))
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Submit the chain without Python: bash submit.sh",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        'mkdir -p "$RUN_DIR/logs"',
        "if ! train_id=$(" + shell_join(train_cmd) + "); then",
        '  echo "submit.sh: sbatch of the training job failed (see the message above); nothing submitted" >&2',
        "  exit 1",
        "fi",
        'train_id=${train_id%%;*}',
    ]
    if plan.consolidate is not None:
        cons_cmd = sbatch_argv(plan.consolidate, str(plan.run_dir / CONSOLIDATE_SBATCH))
        cons_cmd = cons_cmd[:2] + [Expand("--dependency=afterok:${train_id}"), "--kill-on-invalid-dep=yes"] + cons_cmd[2:]
        lines += [
            "if ! cons_id=$(" + shell_join(cons_cmd) + "); then",
            '  echo "submit.sh: sbatch of the consolidation job failed; cancelling training job $train_id" >&2',
            '  scancel "$train_id" || true',
            "  exit 1",
            "fi",
            'cons_id=${cons_id%%;*}',
            f'echo "train $train_id" >> "$RUN_DIR/{JOBS_FILE}"',
            f'echo "consolidate $cons_id" >> "$RUN_DIR/{JOBS_FILE}"',
            'echo "training job:      $train_id"',
            'echo "consolidation job: $cons_id (afterok:$train_id)"',
        ]
    else:
        lines += [
            f'echo "train $train_id" >> "$RUN_DIR/{JOBS_FILE}"',
            'echo "training job:      $train_id"',
        ]
    lines += [
        'echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j $train_id"',
        "",
    ]
    return "\n".join(lines)


def render_eval_sbatch(plan: LaunchPlan) -> str:
    """One checkpoint's consolidation and held-out perplexity: ``sbatch eval.sbatch STEP``."""
    assert plan.eval_job is not None
    return _single_step_sbatch(
        plan, plan.eval_job,
        "# Consolidates checkpoints/step-STEP and appends its held-out perplexity to evals.jsonl.",
        ['STEP=${1:?usage: sbatch eval.sbatch STEP}'])


def render_submit_eval(plan: LaunchPlan) -> str:
    """``bash submit_eval.sh STEP``: what rank 0 runs after each checkpoint (from a clean env)."""
    assert plan.eval_job is not None
    cmd = sbatch_argv(plan.eval_job, str(plan.run_dir / EVAL_SBATCH))
    # One evaluation at a time per run: later ones wait (singleton), training never does.
    cmd = cmd[:2] + ["--dependency=singleton"] + cmd[2:] + [Expand("${STEP}")]
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Submit the evaluation of one saved checkpoint: bash submit_eval.sh STEP",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        'STEP=${1:?usage: bash submit_eval.sh STEP}',
        'case "$STEP" in ""|*[!0-9]*) echo "submit_eval.sh: STEP must be a number, got $STEP" >&2; exit 2;; esac',
        "eval_id=$(" + shell_join(cmd) + ")",
        'eval_id=${eval_id%%;*}',
        f'echo "eval-step-$STEP $eval_id" >> "$RUN_DIR/{JOBS_FILE}"',
        'echo "$eval_id"',
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
    if plan.eval_job is not None:
        out[EVAL_SBATCH] = render_eval_sbatch(plan)
        out[SUBMIT_EVAL_SCRIPT] = render_submit_eval(plan)
    return out
