"""Slurm's scripts: the batch scripts, ``submit.sh``, ``post_checkpoint.sh`` and the ``sbatch`` command.

Built from :mod:`fsdp_workflow.plan.render`'s shell words: every value that came
from the config is quoted; only :class:`~fsdp_workflow.plan.jobs.Expand` arguments,
which the planner builds from constants, are left for the job's shell to expand.
Path-valued sbatch options (``--output``) go on the sbatch command line rather than in
``#SBATCH`` headers, because Slurm's header parser has no quoting for spaces,
quotes or newlines. Run-directory names come from :mod:`fsdp_workflow.core.rundir`.
A local run directory holds these scripts too (the local backend runs ``train_node.sh``,
and ``bash submit.sh`` submits the same run on a cluster later).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from fsdp_workflow.backends.slurm.reasons import NEVER_PATTERN_ERE, POLL_S, WATCH_S, limit_words, never_codes
from fsdp_workflow.backends.slurm.queue import SQUEUE_FORMAT, TERMINAL_STATES
from fsdp_workflow.core.config_hash import CONFIG_CHANGED_CAUSE, replan_argv
from fsdp_workflow.core.exit_codes import EXIT_FAILURE, EXIT_PREFLIGHT, EXIT_REQUEUE, EXIT_USAGE
from fsdp_workflow.core.roles import Role
from fsdp_workflow.core.rundir import (
    CONFIG_FILE,
    EVAL_SBATCH,
    JOB_EXITS_DIR,
    LAUNCH_ENV_FILE,
    POST_CHECKPOINT_HOOK,
    REQUEUE_MARKER,
    STEP_PREFIX,
    SUBMIT_SCRIPT,
    TRAIN_EXIT_FILE,
    TRAIN_NODE_SCRIPT,
    TRAIN_SBATCH,
)
from fsdp_workflow.plan.jobs import NOUN, Expand, LaunchPlan, SbatchJob, job_label
from fsdp_workflow.plan.render import exports, shell_join, shell_word

HEADER = "# Written by fsdp_workflow; the run directory's config.yaml says what it runs."
# torchrun's default list plus Slurm's pre-timeout SIGUSR2.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
# Set inside a job step or by torchrun; inherited by sbatch they would describe the training
# job to the evaluation job (sbatch reads SBATCH_*, srun reads SLURM_*). SLURM_CONF is kept:
# which cluster to talk to is configuration, not job state.
JOB_STATE_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "TORCHELASTIC_")
JOB_STATE_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING")


# ---------------------------------------------------------------- the sbatch command
def sbatch_argv(job: SbatchJob, run_dir: Path, after_id: Optional[str] = None,
                extra: Tuple[str, ...] = ()) -> List[str]:
    """The ``sbatch`` command that submits ``job``: the same list for ``submit.sh`` and for Python.

    Args:
        job: the job.
        run_dir: where its batch script lies.
        after_id: the job id it depends on (``afterok``), when ``job.after`` is set;
            an :class:`Expand` such as ``${train_id}`` in a rendered script.
        extra: more sbatch options, before the script (``--dependency=singleton``).
    """
    argv = ["sbatch", "--parsable"]
    if job.after is not None:
        if after_id is None:
            raise ValueError(f"the {job.role} job waits for the {job.after} job: pass its id")
        dep = f"--dependency=afterok:{after_id}"
        # Cancelling (or failing) the job waited for cancels this one instead of leaving it pending forever.
        argv += [Expand(dep) if isinstance(after_id, Expand) else dep, "--kill-on-invalid-dep=yes"]
    argv += list(extra)
    argv += [f"--{key}={value}" for key, value in sorted(job.path_options.items())]
    return argv + [str(run_dir / job.script)]


# ---------------------------------------------------------------- pieces of job scripts
def _sbatch_header(job: SbatchJob) -> List[str]:
    lines = ["#!/bin/bash"]
    for key, value in job.options:
        lines.append(f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={value}")
    return lines


def _run_dir_lines(plan: LaunchPlan) -> List[str]:
    return [f"RUN_DIR={shlex.quote(str(plan.run_dir))}"]


def _in_run_dir(name: str) -> str:
    """``"$RUN_DIR/name"`` for a name from the run-directory contract (a constant, never config)."""
    return f'"$RUN_DIR/{name}"'


def launcher_signal_lines(plan: LaunchPlan) -> List[str]:
    """Make the launcher pass SIGUSR2/SIGTERM on to every rank and wait for their checkpoint.

    torchrun starts each rank in a session of its own, so a signal sent to torchrun
    reaches the ranks only if torchrun re-sends it; it then waits
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds before SIGKILL. ``PET_SIGNALS_TO_HANDLE``
    is the variable form of ``--signals-to-handle``, read by torchrun's parser and so
    by ``accelerate launch``, which runs the same agent in-process.
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


def rendezvous_lines(plan: LaunchPlan) -> List[str]:
    """MASTER_ADDR/MASTER_PORT in the batch shell: the first host, a port from the job id."""
    return [
        "# Rendezvous on the first host of the allocation, never localhost.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# A port derived from the job id, below the ephemeral range (32768+).",
        f"MASTER_PORT=$(( {plan.master_port_base} + SLURM_JOB_ID % {plan.port_range} ))",
        "export MASTER_ADDR MASTER_PORT",
    ]


def site_env_lines(plan: LaunchPlan) -> List[str]:
    """``cluster.modules`` and ``cluster.env_script``, quoted: each value is one word; then the code snapshot.

    The snapshot goes first on ``PYTHONPATH`` after the site's own setup, so an
    ``env_script`` that sets ``PYTHONPATH`` cannot put another copy of the package
    in front of the one that was submitted.
    """
    lines = [f"module load {shlex.quote(m)}" for m in plan.modules]
    if plan.env_script:
        lines.append(f". {shlex.quote(plan.env_script)}")
    if plan.python_dir is not None:
        lines.append(f"export PATH={shlex.quote(plan.python_dir)}:$PATH"
                     "  # the interpreter that planned (and its torchrun), whatever the submitting shell had")
    if plan.code_dir is not None:
        lines.append(f"export PYTHONPATH={shlex.quote(str(plan.code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}"
                     "  # the code as submitted (cluster.code_snapshot)")
        # `python -m` (and torchrun's ranks) put the working directory first on sys.path: a job submitted
        # from the checkout would import the checkout, edited since, instead of the snapshot (Python >= 3.11).
        lines.append("export PYTHONSAFEPATH=1")
    return lines


def exit_record_lines(role: Role, on_term: bool) -> List[str]:
    """An ``EXIT`` trap that writes ``job_exits/<role>-<job id>.json`` (:mod:`fsdp_workflow.core.job_exit`).

    Written by the shell, so a job whose Python never started (a missing module, exit 127)
    still leaves its code; every field is a number or a constant, so the JSON needs no
    quoting. ``on_term``: a SIGTERM (scancel, the time limit) ends the script through the
    trap (exit 143); the training job leaves SIGTERM to its own handling.
    """
    exits = _in_run_dir(JOB_EXITS_DIR)
    rec = f'{exits}/"{role}-${{SLURM_JOB_ID:-0}}.json"'
    fmt = ('{"role": "' + role + '", "job_id": "%s", "exit_code": %d, "cause": "%s", "restart": %d, '
           '"time": %d}\\n')
    lines = [
        "# Every job leaves its exit code (and a cause the script knows) for status: job_exits/ROLE-ID.json.",
        "JOB_CAUSE=",
        "job_exit_record() {",
        "  local rc=${1:-$?}",
        f"  mkdir -p {exits} && printf '{fmt}' "
        + '"${SLURM_JOB_ID:-0}" "$rc" "$JOB_CAUSE" "${SLURM_RESTART_COUNT:-0}" "$(date +%s)" '
        + f"> {rec}.tmp && mv -f {rec}.tmp {rec} || true",
        "}",
        "trap job_exit_record EXIT",
    ]
    if on_term:
        lines.append("trap 'exit 143' TERM")
    return lines


def config_check_lines(plan: LaunchPlan, role: Role) -> List[str]:
    """Stop at once when ``config.yaml`` is not the file that was validated (:mod:`fsdp_workflow.core.config_hash`)."""
    replan = shell_join(replan_argv(plan.run_dir))
    return [
        f"# The config that runs is the config that was validated: sha256 of {CONFIG_FILE} as planned.",
        f"CONFIG_SHA256={plan.config_sha256}",
        f'if [ "$(sha256sum < {_in_run_dir(CONFIG_FILE)} | cut -d " " -f 1)" != "$CONFIG_SHA256" ]; then',
        f"  JOB_CAUSE={CONFIG_CHANGED_CAUSE}",
        f'  echo "[fsdp_workflow] {NOUN[role]} job ${{SLURM_JOB_ID:-}}: {CONFIG_FILE} changed since planning '
        "(sha256 is not $CONFIG_SHA256): it is not the config that was validated; nothing was run. To run the "
        f'edited config, validate and record it: {_dq(replan)}, then submit again." >&2',
        f"  exit {EXIT_USAGE}",
        "fi",
    ]


def _dq(text: str) -> str:
    """``text`` for the inside of a double-quoted echo: ``"``, ``$``, backslash and backtick escaped."""
    return "".join("\\" + c if c in '"$`\\' else c for c in text)


def job_start_lines(plan: LaunchPlan, role: Role, on_term: bool = True) -> List[str]:
    """The first lines of every batch script: the run directory, the exit record, the config check."""
    return [*_run_dir_lines(plan), *exit_record_lines(role, on_term), *config_check_lines(plan, role)]


# How to go on once the requeues are spent; part of a double-quoted echo in train.sbatch.
CONTINUE_HINT = ("To continue from the newest checkpoint, resubmit with checkpoint.resume=auto (the default), "
                 f"e.g. bash $RUN_DIR/{SUBMIT_SCRIPT}, or raise cluster.max_requeues.")


def requeue_lines() -> List[str]:
    """Right after the training step, in the batch shell: requeue (bounded) or pass the exit code on.

    The decision is taken here, outside the step, so ``srun --kill-on-bad-exit`` can
    never kill the process that decides.
    """
    marker = _in_run_dir(REQUEUE_MARKER)
    record = _in_run_dir(TRAIN_EXIT_FILE)
    return [
        "rc=$?",
        "# srun reports any failed rank as 1: take the trainer's own code (65, 74, 75, 76) from the",
        "# train_exit.json this run wrote, so the job's exit code says why it failed.",
        f'if [ "$rc" -ne 0 ] && [ -f {record} ] && [ "$(stat -c %Y {record})" -ge "$STARTED" ]; then',
        f"  code=$(sed -n 's/.*\"exit_code\": *\\([0-9][0-9]*\\).*/\\1/p' {record} | head -n 1)",
        '  if [ -n "$code" ] && [ "$code" -ne 0 ]; then rc=$code; fi',
        "fi",
        f'if [ "$rc" -ne 0 ] && [ -f {marker} ]; then',
        '  if [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then',
        '    echo "[fsdp_workflow] checkpoint saved on a signal: requeueing job $SLURM_JOB_ID" >&2',
        '    scontrol requeue "$SLURM_JOB_ID"',
        f"    exit {EXIT_REQUEUE}",
        "  fi",
        '  echo "[fsdp_workflow] preempted again at restart ${SLURM_RESTART_COUNT:-0}/$MAX_REQUEUES, out of '
        'requeues (cluster.max_requeues=$MAX_REQUEUES): failing. ' + CONTINUE_HINT + '" >&2',
        "fi",
        'exit "$rc"',
    ]


def requeue_guard_lines() -> List[str]:
    """First thing in the batch shell: refuse a run past ``cluster.max_requeues``.

    :func:`requeue_lines` bounds the requeues this script asks for, but Slurm also
    requeues on its own (preemption with PreemptMode=REQUEUE, a node failure, an
    admin's ``scontrol requeue``), and those bypass it. Counting restarts here
    bounds every route: the run after the ``max_requeues``-th requeue fails at once.
    """
    return [
        "# Slurm requeues on its own too (preemption, node failure, scontrol requeue): bound every route.",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt "$MAX_REQUEUES" ]; then',
        '  echo "[fsdp_workflow] train job $SLURM_JOB_ID restart $SLURM_RESTART_COUNT/$MAX_REQUEUES: requeued more '
        'often than cluster.max_requeues=$MAX_REQUEUES allows (by Slurm: preemption, node failure or scontrol '
        'requeue); failing before training starts. ' + CONTINUE_HINT + '" >&2',
        f"  exit {EXIT_FAILURE}",
        "fi",
    ]


PREFLIGHT_CAUSE = "preflight"  # the exit record's cause when the preflight step failed


def preflight_lines(plan: LaunchPlan) -> List[str]:
    """Before the training step: one task per node checks the allocation (:mod:`fsdp_workflow.preflight`).

    A failure ends the job with exit 66 before any rank starts; the consolidation job,
    ``afterok`` on this one, is then cancelled by Slurm (``--kill-on-invalid-dep``).
    Nothing is rendered with ``cluster.preflight=false``.
    """
    if not plan.preflight_argv:
        return []
    return [
        "# Preflight (cluster.preflight): every node sees RUN_DIR, runs the planned code and the same torch and",
        "# transformers, has its GPUs, reaches the master address and port, and joins a tiny all-reduce (seconds).",
        "if ! " + shell_join(plan.preflight_argv) + "; then",
        f"  JOB_CAUSE={PREFLIGHT_CAUSE}",
        '  echo "[fsdp_workflow] train job $SLURM_JOB_ID: preflight failed (the lines above name the node, the check '
        'and the fix); nothing was trained. To skip the checks: cluster.preflight=false" >&2',
        f"  exit {EXIT_PREFLIGHT}",
        "fi",
    ]


# ---------------------------------------------------------------- scripts
def render_train_node(plan: LaunchPlan) -> str:
    """What one task per node runs: load launch.env, then start this node's ranks."""
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Runs once per node (srun --ntasks-per-node=1). SLURM_NODEID is read here, in the",
        "# task, so every node gets its own rank; the batch shell would expand it to 0.",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        f"set -a; . {_in_run_dir(LAUNCH_ENV_FILE)}; set +a",
        ': "${MASTER_ADDR:?MASTER_ADDR is set by train.sbatch (first host of the allocation)}"',
        ': "${MASTER_PORT:?MASTER_PORT is set by train.sbatch (derived from the job id)}"',
        'echo "[fsdp_workflow] host $(hostname) node_rank ${SLURM_NODEID:-0} of '
        f'{plan.nnodes} master $MASTER_ADDR:$MASTER_PORT" >&2',
        *launcher_signal_lines(plan),
        "exec " + shell_join(plan.node_script_argv),
        "",
    ]
    return "\n".join(lines)


def render_train_sbatch(plan: LaunchPlan) -> str:
    job = plan.train
    lines = _sbatch_header(job) + [
        HEADER,
        "set -uo pipefail",
        *job_start_lines(plan, Role.train, on_term=False),  # requeues run these too
        *site_env_lines(plan),
        f"MAX_REQUEUES={plan.max_requeues}",
        *requeue_guard_lines(),
        # forget a marker left by an earlier run: it would turn a later failure into "requeue me"
        f"rm -f {_in_run_dir(REQUEUE_MARKER)}",
        *exports(plan.nccl_env),
        *rendezvous_lines(plan),
        'echo "[fsdp_workflow] train job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}/'
        '$MAX_REQUEUES nodes $SLURM_JOB_NODELIST master $MASTER_ADDR:$MASTER_PORT" >&2',
        *preflight_lines(plan),
        "STARTED=$(date +%s)",
        shell_join(job.as_step(job.argv)),
        *requeue_lines(),
        "",
    ]
    return "\n".join(lines)


def _single_step_sbatch(plan: LaunchPlan, job: SbatchJob, comment: str, pre: List[str],
                       cleanup: Sequence[str] = (), at_start: bool = True) -> str:
    """A one-step CPU job (preparation, consolidation, evaluation): header, checks, site environment, the step.

    The step is not ``exec``'d: the shell stays to write the exit record and run
    ``cleanup`` (staging left by a killed step) on every way out, and first (``at_start``)
    for what an earlier, killed run of the job left.
    """
    lines = _sbatch_header(job) + [
        HEADER,
        comment,
        "set -euo pipefail",
        *pre,
        *job_start_lines(plan, job.role),
    ]
    if cleanup:
        lines += ["# Staging directories go on every way out (the exit code is kept for the record).",
                  "cleanup_staging() {", *(f"  {c}" for c in cleanup), "}",
                  *(["cleanup_staging  # what a killed earlier run left"] if at_start else []),
                  "trap 'rc=$?; cleanup_staging || true; job_exit_record \"$rc\"' EXIT"]
    lines += [
        *site_env_lines(plan),
        *(shell_join(job.as_step(argv)) for argv in [*job.before_argvs, job.argv, *job.after_argvs]),
        "",
    ]
    return "\n".join(lines)


# What each one-step job of the chain says about itself.
CHAIN_COMMENTS = {
    Role.prepare: "# Tokenises, masks and packs the data once, on CPU; training starts afterok.",
    Role.consolidate: "# Starts only after the training job succeeded (afterok, kill-on-invalid-dep).",
}


def _staging_rm(model_dir: str) -> str:
    """Remove a consolidation's staging directories beside ``model_dir`` (``.NAME.tmp-PID``)."""
    parent, _, name = model_dir.rpartition("/")
    return f"rm -rf {shlex.quote(parent or '/')}/{shlex.quote('.' + name + '.tmp-')}*"


def render_cpu_job_sbatch(plan: LaunchPlan, job: SbatchJob) -> str:
    """A CPU job of the chain (data preparation, consolidation)."""
    cleanup: List[str] = []
    if job.role == Role.consolidate:  # a requeued or killed consolidation leaves .hf_model.tmp-<pid>
        cleanup = [_staging_rm(str(plan.layout.hf_model)), _staging_rm(str(plan.layout.hf_model_ema))]
    return _single_step_sbatch(plan, job, CHAIN_COMMENTS[job.role], [], cleanup)


def render_eval_sbatch(plan: LaunchPlan, job: SbatchJob) -> str:
    """One checkpoint's consolidation and held-out perplexity: ``sbatch eval.sbatch STEP``.

    Its hard-linked snapshot (``evals/pending/step-STEP``) and consolidated copy go on
    every way out, a cancelled or killed job included.
    """
    layout = plan.layout
    return _single_step_sbatch(
        plan, job,
        "# Consolidates checkpoints/step-STEP and appends its held-out perplexity to evals.jsonl.",
        ['STEP=${1:?usage: sbatch eval.sbatch STEP}'],
        [f'rm -rf {shell_word(str(layout.pending_evals))}/{STEP_PREFIX}"$STEP"'], at_start=False)


def _submit_lines(plan: LaunchPlan, job: SbatchJob, submitted: List[SbatchJob]) -> List[str]:
    """Submit one job of the chain; on failure cancel the jobs already submitted and stop."""
    var = f"{job.role}_id"
    after = Expand(f"${{{job.after}_id}}") if job.after else None
    cmd = sbatch_argv(job, plan.run_dir, after)
    if submitted:
        earlier = " and ".join(f"{NOUN[j.role]} job ${j.role}_id" for j in submitted)
        failed = [f'  echo "submit.sh: sbatch of the {NOUN[job.role]} job failed; cancelling {earlier}" >&2',
                  "  scancel " + " ".join(f'"${j.role}_id"' for j in submitted) + " || true"]
    else:
        failed = [f'  echo "submit.sh: sbatch of the {NOUN[job.role]} job failed (see the message above); '
                  'nothing submitted" >&2']
    return [f"if ! {var}=$(" + shell_join(cmd) + "); then", *failed, "  exit 1", "fi", f"{var}=${{{var}%%;*}}"]


def chain_guard_lines(plan: LaunchPlan) -> List[str]:
    """``submit.sh``'s first question: is a chain of this run directory still queued or running, or done?

    The same rules as :mod:`fsdp_workflow.backends.slurm.live_chain` (the Python route): a live
    job of ``jobs.txt`` refuses (exit 2, with how to follow or cancel it); a run trained
    to ``train.max_steps`` with its model written is complete (exit 0, nothing
    submitted); a model of an earlier, shorter run must be moved aside before continuing.
    The live jobs are asked of squeue in shell; whether the run is complete is asked of
    the planning interpreter (``python -m fsdp_workflow.launch.chain_guard``), since it
    depends on whether the newest checkpoint would pass resume's check.
    """
    layout = plan.layout
    jobs, model = _in_run_dir(layout.jobs.name), shell_word(str(layout.hf_model))
    terminal = "|".join(TERMINAL_STATES)
    status = 'python -m fsdp_workflow.status $(printf %q "$RUN_DIR")'
    lines = [
        "# One live chain per run directory: a job of jobs.txt still queued or running refuses.",
        f"if [ -s {jobs} ]; then",
        f"  ids=$(awk 'NF >= 2 {{print $2}}' {jobs} | paste -sd , -)",
        '  if ! out=$(squeue -h -j "$ids" -o "%i %T %r" 2>&1); then',
        '    case "$out" in *"Invalid job id"*) out="";; *) echo "submit.sh: cannot ask Slurm about the jobs of '
        'jobs.txt ($out); nothing submitted" >&2; exit 1;; esac',
        "  fi",
        f"  live=$(printf '%s\\n' \"$out\" | awk 'NF >= 2 && $2 !~ /^({terminal})$/')",
        '  if [ -n "$live" ]; then',
        '    echo "submit.sh: a chain of this run directory is still in the queue; nothing submitted:" >&2',
        "    printf '%s\\n' \"$live\" | awk '{print \"  job \" $1 \": \" $2 (NF > 2 ? \" (\" $3 \")\" : \"\")}' >&2",
        f'    echo "follow it: {status}" >&2',
        "    echo \"or cancel it, then submit again: scancel $(printf '%s\\n' \"$live\" | awk '{print $1}' | "
        "paste -sd ' ' -)\" >&2",
        f"    exit {EXIT_USAGE}",
        "  fi",
        "fi",
    ]
    # Complete or not is the Python route's answer (backends.finished.finished_message), asked of the planning
    # interpreter and the code snapshot: the newest checkpoint that passes resume's check, never any
    # step-N directory (a truncated shard would have made a damaged run "complete").
    ask = ["env", *([f"PYTHONPATH={layout.code}", "PYTHONSAFEPATH=1"] if plan.code_dir is not None else []),
           plan.planner_python, "-m", "fsdp_workflow.launch.chain_guard", str(layout.root),
           "--max-steps", str(plan.max_steps), *(["--consolidates"] if plan.consolidate is not None else [])]
    lines += [
        "# A run already complete submits nothing; the model of an earlier, shorter run must be moved first.",
        "guard=0",
        f"complete=$({' '.join(shell_word(a) for a in ask)}) || guard=$?",
        f'if [ "$guard" = {EXIT_USAGE} ]; then exit {EXIT_USAGE}; fi  # the reason is on stderr',
        'if [ "$guard" != 0 ]; then',
        f'  echo "submit.sh: could not tell whether this run is already complete (python -m '
        f'fsdp_workflow.launch.chain_guard, run by {_dq(plan.planner_python)}, exited $guard; see above); nothing '
        'submitted" >&2',
        "  exit 1",
        "fi",
        'if [ -n "$complete" ]; then printf \'%s\\n\' "$complete"; exit 0; fi',
    ]
    return lines


def _reason_line(words: str, fix: str) -> str:
    return f"printf '%s\\n' {shell_word(f'{words}; fix: {fix}')}"


def pending_watch_lines(plan: LaunchPlan) -> List[str]:
    """``submit.sh`` right after sbatch: a pending reason that means "never" cancels the whole chain (exit 2).

    :mod:`fsdp_workflow.backends.slurm.pending` in shell, from the same table
    (:mod:`fsdp_workflow.backends.slurm.reasons`): Slurm sets each job's reason at its first
    scheduling pass; the poll ends once every pending job has one and none means
    "never", or after ``WATCH_S`` (a "never" is read again to the end: the first,
    coarse reason becomes the precise one). A Slurm that does not answer ends the
    watch: the chain stays submitted, as on the Python route.
    """
    ids = [f"${job.role}_id" for job in plan.chain]
    lines = [
        '# A chain Slurm will never start (its pending reason says so) is cancelled, not reported submitted.',
        "never_reason() {  # Slurm's reason -> what it means and the fix; status 1 when it is a wait",
        "  local head=${1%%[,(]*}",
        "  head=${head//[[:space:]]/}",
        '  case "$head" in',
    ]
    for code, (words, fix) in never_codes().items():
        lines.append(f"    {code}) {_reason_line(words, fix)}; return 0;;")
    qos, assoc = limit_words("QoS"), limit_words("association")
    lines += [
        "    *PerUser|*PerAccount) return 1;;",
        "  esac",
        f"  local limit={shell_word(NEVER_PATTERN_ERE)}",
        '  [[ $head =~ $limit ]] || return 1',
        f'  case "$head" in QOS*) {_reason_line(*qos)};; *) {_reason_line(*assoc)};; esac',
        "}",
        'job_noun() {',
        '  case "$1" in',
        *[f'    "${job.role}_id") echo "{NOUN[job.role]} job";;' for job in plan.chain],
        "  esac",
        "}",
        'stuck=""',
        f"for _ in $(seq {int(WATCH_S / POLL_S)}); do",
        '  out=$(squeue -h -j "' + ",".join(ids) + '" -o "' + SQUEUE_FORMAT + '" 2>/dev/null) || break',
        '  stuck=""; settled=1',
        "  while IFS='|' read -r id state reason; do",
        '    [ "$state" = PENDING ] || continue',
        '    case "$reason" in None|"") settled=0;; esac',
        "    if why=$(never_reason \"$reason\"); then stuck+=\"  $(job_noun \"$id\") $id: PENDING ($reason): $why\"$'\\n'; fi",
        '  done <<< "$out"',
        '  if [ -z "$stuck" ] && [ "$settled" = 1 ]; then break; fi',
        f"  sleep {POLL_S:g}",
        "done",
        'if [ -n "$stuck" ]; then',
        "  scancel " + " ".join(f'"{i}"' for i in ids) + " || true",
        '  echo "submit.sh: Slurm would never start this chain:" >&2',
        """  printf '%s' "$stuck" >&2""",
        '  echo "submit.sh: cancelled the whole chain (' + ", ".join(ids) + '): none of it stays in the queue; '
        'change the config, plan the run again and resubmit" >&2',
        f"  exit {EXIT_USAGE}",
        "fi",
    ]
    return lines


def render_submit(plan: LaunchPlan) -> str:
    """A plain-sbatch chain: training, then consolidation afterok, without ``python -m fsdp_workflow``.

    The one Python it runs on the login node is the planning interpreter's completeness
    check (:func:`chain_guard_lines`); the chain itself is submitted by plain sbatch.

    ``python -m fsdp_workflow`` submits the same ``sbatch`` commands
    (:func:`sbatch_argv`). If a later job cannot be
    submitted, the earlier ones are cancelled: nothing is left half-submitted; nor is
    a chain Slurm would never start (:func:`pending_watch_lines`).
    """
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Submit the chain with plain sbatch, without python -m fsdp_workflow: bash submit.sh",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        *chain_guard_lines(plan),
        "mkdir -p " + shell_word(str(plan.layout.logs)),
    ]
    for i, job in enumerate(plan.chain):
        lines += _submit_lines(plan, job, plan.chain[:i])
    lines += pending_watch_lines(plan)
    jobs = _in_run_dir(plan.layout.jobs.name)
    lines += [f'echo "{job.role} ${job.role}_id" >> {jobs}' for job in plan.chain]
    for job in plan.chain:
        after = f" (afterok:${job.after}_id)" if job.after else ""
        lines.append(f'echo "{job_label(job.role)}${job.role}_id{after}"')
    lines += [
        f'echo "follow: python -m fsdp_workflow.status $(printf %q "$RUN_DIR")   or   squeue -j ${plan.train.role}_id"',
        "",
    ]
    return "\n".join(lines)


def render_post_checkpoint(plan: LaunchPlan, job: SbatchJob) -> str:
    """``bash post_checkpoint.sh STEP``: run by rank 0 after ``step-STEP`` is committed.

    Hard-links the checkpoint for its evaluation job (the trainer's ``keep_last``
    pruning may delete ``step-STEP`` while the job waits; links keep the files and
    cost no copy) and submits ``eval.sbatch STEP``, one evaluation at a time
    (``singleton``). The training job's Slurm and torchrun variables are dropped
    first, so sbatch does not take them for the new job's settings.
    """
    layout = plan.layout
    cmd = sbatch_argv(job, plan.run_dir, extra=("--dependency=singleton",)) + [Expand("${STEP}")]
    strip = "|".join(f"{p}*" for p in JOB_STATE_PREFIXES)
    lines = [
        "#!/bin/bash",
        HEADER,
        "# Run by rank 0 after each committed checkpoint: bash post_checkpoint.sh STEP",
        "set -euo pipefail",
        *_run_dir_lines(plan),
        'STEP=${1:?usage: bash post_checkpoint.sh STEP}',
        'case "$STEP" in ""|*[!0-9]*) echo "post_checkpoint.sh: STEP must be a number, got $STEP" >&2; '
        f"exit {EXIT_USAGE};; esac",
        "# The training job's variables would describe it to the new job; which cluster (SLURM_CONF) stays.",
        f'for n in $(compgen -e); do case "$n" in SLURM_CONF) ;; {strip}) unset "$n";; esac; done',
        "unset " + " ".join(JOB_STATE_NAMES),
        f"src={shell_word(str(layout.checkpoints))}/{STEP_PREFIX}$STEP",
        f"snap={shell_word(str(layout.pending_evals))}/{STEP_PREFIX}$STEP",
        'rm -rf "$snap"; mkdir -p "${snap%/*}"',
        'cp -al "$src" "$snap"',
        "eval_id=$(" + shell_join(cmd) + ")",
        "eval_id=${eval_id%%;*}",
        f'echo "{job.role}-{STEP_PREFIX}$STEP $eval_id" >> {_in_run_dir(layout.jobs.name)}',
        'echo "$eval_id"',
        "",
    ]
    return "\n".join(lines)


def render_all(plan: LaunchPlan) -> Dict[str, str]:
    """Every script of the run directory, by file name."""
    out = {
        TRAIN_NODE_SCRIPT: render_train_node(plan),
        TRAIN_SBATCH: render_train_sbatch(plan),
        SUBMIT_SCRIPT: render_submit(plan),
    }
    for job in plan.chain:
        if job is not plan.train:
            out[job.script] = render_cpu_job_sbatch(plan, job)
    if plan.eval_job is not None:
        out[EVAL_SBATCH] = render_eval_sbatch(plan, plan.eval_job)
        out[POST_CHECKPOINT_HOOK] = render_post_checkpoint(plan, plan.eval_job)
    return out

