"""Run a plan on this machine: data preparation, the node script under torchrun, then consolidation.

The same ``train_node.sh`` that Slurm runs on each node runs here, with the
rendezvous on 127.0.0.1 and a free port, so a local smoke run exercises the
exact launch a cluster job would.

One run per run directory: :func:`run_local` holds ``RUN_DIR/.lock``
(:mod:`fsdp_workflow.core.lock`) from data preparation to consolidation; a second
command on the same directory is refused at once, naming the holder. Rank 0 sees
the launcher, its ancestor, holding it and trains under it (:mod:`fsdp_workflow.train.runlock`).

No orphans: every process this command starts (the node script, the data, consolidation
and model-card steps, their helper) gets the lock's descriptor, so the lock is held until
the last of them has exited, and SIGTERM from the kernel when this command dies, however
it dies (``kill -9``, the OOM killer, a closed terminal): the node launcher then stops its
ranks as it does for a scheduler's SIGTERM (they checkpoint their step and exit 75), and
each rank dies with the process that forked it (:mod:`fsdp_workflow.core.lifeline`). A
second command on the run directory is refused until they are all gone, naming them.

Signals: SIGUSR2, SIGTERM or SIGINT (Ctrl-C) sent to ``python -m fsdp_workflow``
go to the process group of ``train_node.sh``, which has become torchrun
(``exec``). torchrun starts every rank in a session of its own and re-sends the
signal to each (``train_node.sh`` exports ``PET_SIGNALS_TO_HANDLE``); the ranks
finish their step, checkpoint, and rank 0 writes ``RUN_DIR/.requeue``. The
command then exits 75 and prints the command that resumes. A second Ctrl-C kills
the launch at once (exit 130): a save it cuts short stays ``step-N.tmp``, never
taken for a checkpoint, so the last committed checkpoint is what resumes.

Output: everything torchrun and the ranks print goes to ``RUN_DIR/logs/train-local.log``;
the terminal gets the same minus torchrun's own chatter and its ``ChildFailedError``
traceback, which only repeats that a rank failed. In its place the launcher prints
one line naming the failed rank, its exit code and reason (``train_exit.json``),
and the log, and exits with the rank's code (65, 74, 75, 76, ...), as on Slurm.

The data, consolidation and model-card steps are forked from one helper that imported
torch and transformers once (:mod:`fsdp_workflow.backends.warm`) when the chain holds a
verified consolidation; each still runs as its own ``python -m`` would, in a session of
its own, and gets the signals this command receives.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fsdp_workflow.backends.base import JobState, JobStatus, Role
from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.record import RunRecord, open_run
from fsdp_workflow.config.schema import ClusterKind, WorkflowConfig
from fsdp_workflow.core.commands import local_resume_argv, shell
from fsdp_workflow.core.exit_codes import EXIT_INTERRUPTED, EXIT_REQUEUE, EXIT_TERMINATED, EXIT_USAGE, MEANINGS
from fsdp_workflow.core.lifeline import child_dies_with_me
from fsdp_workflow.core.lock import Lock, LockHeld, LockUnsupported, acquire
from fsdp_workflow.core.rundir import SUBMIT_SCRIPT, RunDir
from fsdp_workflow.backends.finished import finished_message
from fsdp_workflow.backends.slurm.scripts import render_all
from fsdp_workflow.backends.torchrun_io import OutputFilter, descendants, output_channel
from fsdp_workflow.backends.warm import WarmSteps, step_module
from fsdp_workflow.plan.jobs import LaunchPlan, SbatchJob
from fsdp_workflow.plan.render import runtime_argv
from fsdp_workflow.plan.spec import build_plan

log = logging.getLogger(__name__)

LOCAL_TRAIN_LOG = "train-local.log"  # under RUN_DIR/logs/: torchrun's and the ranks' whole output

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started(argv: List[str], env: dict, keep_fds: Tuple[int, ...], **kwargs) -> subprocess.Popen:
    """A child of this command in a session of its own, given ``keep_fds`` (the run's lock), and
    SIGTERM from the kernel if this command dies first (:mod:`fsdp_workflow.core.lifeline`).

    Called from the thread that then waits for the child: the signal follows that thread's end.
    """
    return subprocess.Popen(argv, env=env, start_new_session=True, pass_fds=keep_fds,
                            preexec_fn=child_dies_with_me(signal.SIGTERM), **kwargs)


def _run(argv: List[str], env: dict, warm: Optional[WarmSteps] = None, keep_fds: Tuple[int, ...] = ()) -> int:
    """Run a child in its own process group; forward SIGINT/SIGTERM/SIGUSR2 to all of it.

    With ``warm``, a step it can fork (:func:`fsdp_workflow.backends.warm.step_module`) is
    forked there instead of started afresh; a signal that comes before the step's pid is
    known is sent to it as soon as it is.
    """
    target: List[int] = []
    pending: List[int] = []

    def forward(signum, _frame):
        if not target:
            pending.append(signum)
            return
        try:
            os.killpg(target[0], signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        pid = warm.begin(argv, env) if warm is not None else None
        if pid is None:
            proc = _started(argv, env, keep_fds)
            pid, wait = proc.pid, proc.wait
        else:
            wait = warm.wait
        target.append(pid)
        for signum in pending:
            forward(signum, None)
        rc = wait()
        # Killed by signal N: 128 + N, as a shell reports it; -N would leave this command as 256 - N.
        return 128 - rc if rc < 0 else rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@dataclass
class TrainRun:
    """How the training step ended: torchrun's code, the failed rank and its code, Ctrl-C once or twice."""

    returncode: int
    root_rank: Optional[int]
    root_code: Optional[int]
    interrupted: bool  # a second Ctrl-C killed everything
    ctrl_c: bool  # at least one Ctrl-C reached the launch


def _run_training(argv: List[str], env: dict, log_path: Path, keep_fds: Tuple[int, ...] = ()) -> TrainRun:
    """Run the node script with its output filtered to the terminal and kept whole in ``log_path``.

    The first SIGINT/SIGTERM/SIGUSR2 goes to torchrun's group (it forwards it to
    the ranks, which checkpoint); a second SIGINT kills torchrun and every rank at once.
    """
    reader, writer = output_channel()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = _started(argv, env, keep_fds, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer)
        os.close(writer)
        state = {"sigint": 0, "killed": False}

        def on_signal(signum, _frame):
            if signum == signal.SIGINT:
                state["sigint"] += 1
                if state["sigint"] == 1:
                    os.write(sys.stderr.fileno(), b"\n[fsdp_workflow] Ctrl-C: every rank finishes its step and "
                             b"saves a checkpoint; press Ctrl-C again to stop at once (the last committed "
                             b"checkpoint is kept)\n")
                else:
                    victims = [*descendants(proc.pid), proc.pid]  # all, before any is reparented
                    state["killed"] = True
                    for pid in victims:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
        filt = OutputFilter(sys.stderr.buffer)
        try:
            while True:
                try:
                    data = os.read(reader, 65536)
                except OSError:  # EIO: the pty's last writer is gone
                    data = b""
                if not data:
                    break
                log_file.write(data)
                log_file.flush()
                if not state["killed"]:
                    filt.feed(data)
            if not state["killed"]:
                filt.close()
            rc = proc.wait()
        finally:
            os.close(reader)
            for s, h in old.items():
                signal.signal(s, h)
    return TrainRun(rc, filt.root_rank, filt.root_code, state["killed"], state["sigint"] > 0)


# ---------------------------------------------------------------- what the user reads
def resume_command(root: Path) -> str:
    """The command that resumes this run, pasteable into a shell (every word quoted, ``run_dir`` for Hydra too).

    The command line that started this process, with ``run_dir`` made absolute and
    ``checkpoint.resume=auto``; outside the CLI, the bare command for the run directory.
    """
    cli = Path(sys.argv[0]).parent.name == "fsdp_workflow" or Path(sys.argv[0]).name == "fsdp-workflow"
    return shell(local_resume_argv(root, sys.argv if cli else None))


def _train_exit(layout: RunDir, since: float) -> Optional[dict]:
    """The trainer's ``train_exit.json`` when this launch wrote it (None: none, older, or unreadable).

    Asked of the run record, the file's one reader; a second of slack for filesystems whose
    mtime is coarser than ``time.time()``.
    """
    return open_run(layout.root).train_exit_since(since - 1)


def _failure_line(run: TrainRun, record: Optional[dict], log_path: Path) -> Tuple[int, str]:
    """The command's exit code (the rank's, as on Slurm) and the one line that explains it."""
    code = run.returncode
    if run.root_code is not None and run.root_code > 0:
        code = run.root_code
    if record and isinstance(record.get("exit_code"), int) and record["exit_code"] > 0:
        code = record["exit_code"]
    who = f"rank {run.root_rank}" if run.root_rank is not None else "a rank"
    reason = f": {record['reason']}" if record and record.get("reason") else ""
    meaning = MEANINGS.get(code, "failed")
    return code, (f"[fsdp_workflow] training failed: {who} exited with code {code} ({meaning}){reason}. "
                  f"Full log: {log_path}; consolidation skipped.")


def run_local(plan: LaunchPlan, consolidate: bool, lock: Optional[Lock] = None) -> int:
    """Train, then consolidate, holding the run directory's lock throughout.

    Args:
        plan: the written plan.
        consolidate: run the consolidation after training (``consolidate.enabled``).
        lock: the run's lock, already held by the caller (the CLI takes it before
            planning); None to take it here.

    Returns:
        The exit code for the CLI: 0, the failed rank's code (65, 74, 75, 76, ...),
        2 when another process holds the run directory, 130 after a second Ctrl-C.
    """
    held = lock
    if held is None:
        try:
            held = acquire(plan.layout.lock, "training (local launcher)", subject=f"run directory {plan.layout.root}")
        except (LockHeld, LockUnsupported) as err:
            log.error("[fsdp_workflow] refused: %s", err)
            return EXIT_USAGE
    try:
        return _run_locked(plan, consolidate, held)
    finally:
        if lock is None:
            held.release()


def _as_if_activated(env: dict) -> dict:
    """Give the children this interpreter's virtualenv as ``activate`` would.

    ``train_node.sh`` runs ``torchrun`` by name. Run from a venv's console script
    without activating it (``/opt/venv/bin/fsdp-workflow``), PATH would find another
    environment's torchrun, whose ranks import another fsdp_workflow, or none.
    """
    if sys.prefix != sys.base_prefix and env.get("VIRTUAL_ENV") != sys.prefix:
        env["VIRTUAL_ENV"] = sys.prefix
        env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH")]))
    return env


def _stopped(returncode: int) -> Optional[Tuple[int, str]]:
    """A child step ended by a signal: (the command's exit code, the signal in words); None otherwise.

    Ctrl-C: killed by SIGINT, or exited 130 after handling it. SIGTERM (``kill``, ``timeout``,
    a closing terminal; forwarded by :func:`_run`): killed by it, or exited 143 after cleaning up.
    """
    if returncode == EXIT_INTERRUPTED:
        return EXIT_INTERRUPTED, "interrupted (Ctrl-C)"
    if returncode == EXIT_TERMINATED:
        return EXIT_TERMINATED, "terminated (SIGTERM)"
    return None


def _code_words(returncode: int) -> str:
    """``exit code 137 (killed by SIGKILL)``: a step's code, with the signal that killed it."""
    try:
        killed = f" (killed by {signal.Signals(returncode - 128).name})" if returncode > 128 else ""
    except ValueError:
        killed = ""
    return f"exit code {returncode}{killed}"


def shown(argv: List[str]) -> str:
    """A step's command as the log shows it: quoted, and in an image the runtime's command line
    (``apptainer exec ... python -m ...``), without the environment filter that runs it."""
    return shell(runtime_argv(argv))


def _this_python(argv: List[str]) -> List[str]:
    """A ``python -m ...`` step run by this interpreter: the same environment as the trainer's."""
    return [sys.executable, *argv[1:]] if argv[:1] == ["python"] else list(argv)


def _worth_a_helper(jobs: Sequence[SbatchJob]) -> bool:
    """Whether the chain's steps share the helper's import of torch (:mod:`fsdp_workflow.backends.warm`).

    Only a verified consolidation imports torch and transformers (to load the result); a
    chain without one, or whose steps run in a container, runs each step as its own process.
    """
    steps = [_this_python(a) for j in jobs if j.role != Role.train for a in (*j.before_argvs, j.argv, *j.after_argvs)]
    forkable = [a for a in steps if step_module(a) is not None]
    verified = any(step_module(a) == "fsdp_workflow.consolidate" and "--no-verify" not in a for a in forkable)
    return verified and len(forkable) >= 2


@dataclass
class _Steps:
    """How this command starts the chain's steps: their environment, the descriptors they keep
    (the run's lock), and the helper that forks the steps it can (None: each is started)."""

    env: dict
    keep_fds: Tuple[int, ...]
    warm: Optional[WarmSteps] = None

    def run(self, argv: List[str]) -> int:
        return _run(argv, self.env, self.warm, self.keep_fds)


def _run_locked(plan: LaunchPlan, consolidate: bool, lock: Lock) -> int:
    """:func:`run_local` once ``lock`` is held: the plan's chain, job after job, as Slurm would."""
    layout = plan.layout
    # The same command again after the run ended: nothing to train, and a merge (hours and the
    # model's size in RAM on a large model) that would only rewrite the same verified weights.
    # (A model of an earlier, shorter run is replaced here: the local consolidation runs with --overwrite.)
    done, _ = finished_message(layout, plan.max_steps, consolidate, local=True)
    if done:
        print(f"[fsdp_workflow] {done}")
        return 0
    env = _as_if_activated(dict(os.environ))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    if plan.code_dir is not None:  # the code as planned (cluster.code_snapshot), as the Slurm jobs run it
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plan.code_dir), env.get("PYTHONPATH")]))
        env["PYTHONSAFEPATH"] = "1"  # not the working directory's copy first (see backends.slurm.scripts.site_env_lines)
    env.update(plan.nccl_env)
    # A marker left by an earlier preempted run in this directory would turn a later
    # failure into "stopped on a signal"; train.sbatch removes it the same way.
    layout.requeue_marker.unlink(missing_ok=True)
    jobs: List[SbatchJob] = []
    for job in plan.chain:
        if job.role == Role.consolidate and not consolidate:
            break
        jobs.append(job)
    # Every process started from here holds the lock with this command (see the module's docstring).
    steps = _Steps(env, (lock.fileno(),))
    steps.warm = WarmSteps.start(env, steps.keep_fds) if _worth_a_helper(jobs) else None
    consolidated = None
    try:
        for job in jobs:
            assert job.role in _JOB_RUNNERS, f"the local launcher has no runner for the chain's {job.role} job"
            rc = _JOB_RUNNERS[job.role](plan, job, steps)
            if rc is not None:
                return rc
            if job.role == Role.consolidate:
                consolidated = job
    finally:
        if steps.warm is not None:
            steps.warm.close()
    if consolidated is None:
        log.info("[fsdp_workflow] done; checkpoints in %s", layout.checkpoints)
        return 0
    out = str(layout.hf_model)
    print(f"[fsdp_workflow] done. Consolidated, verified model: {out}")
    if consolidated.before_argvs:  # the EMA's consolidation (train.ema_decay)
        print(f"  and its EMA: {layout.hf_model_ema}")
    print(f"  load it with: AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


def _prepare(plan: LaunchPlan, job: SbatchJob, steps: _Steps) -> Optional[int]:
    """The data preparation job; None once it succeeded, else the command's exit code."""
    log.info("[fsdp_workflow] preparing the data (tokenise, mask, pack once)")
    rc = steps.run(_this_python(job.argv))
    stopped = _stopped(rc)
    if stopped:
        print(f"[fsdp_workflow] {stopped[1]} while preparing the data (exit {stopped[0]}); "
              "nothing was trained and no partial cache is used. Run the same command again to prepare "
              "from the start.", file=sys.stderr)
        return stopped[0]
    if rc != 0:
        log.error("[fsdp_workflow] data preparation failed (%s); nothing was trained.", _code_words(rc))
        return rc
    return None


def _train(plan: LaunchPlan, job: SbatchJob, steps: _Steps) -> Optional[int]:
    """The training job (``train_node.sh`` under this launcher); None once it succeeded."""
    layout = plan.layout
    log_path = layout.logs / LOCAL_TRAIN_LOG
    log.info("[fsdp_workflow] training: log %s, metrics in %s", log_path, layout.metrics)
    started = time.time()
    run = _run_training(job.argv, steps.env, log_path, steps.keep_fds)
    if run.interrupted:
        latest = layout.latest_checkpoint()
        kept = str(latest[1]) if latest else "none yet"
        print(f"[fsdp_workflow] stopped at once on a second Ctrl-C (exit {EXIT_INTERRUPTED}); last committed "
              f"checkpoint: {kept}. Resume with: {resume_command(layout.root)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if run.returncode == 0:
        return None
    if layout.requeue_marker.exists():
        log.warning("[fsdp_workflow] training stopped on a signal after saving a checkpoint; rerun the same "
                    "command with checkpoint.resume=auto run_dir=%s to continue.", layout.root)
        print(f"[fsdp_workflow] resume with: {resume_command(layout.root)}", file=sys.stderr)
        return EXIT_REQUEUE
    record = _train_exit(layout, started)
    if run.ctrl_c and record is None:  # stopped before a step could finish and be saved
        print(f"[fsdp_workflow] interrupted (Ctrl-C) before a checkpoint could be saved (exit "
              f"{EXIT_INTERRUPTED}); full log: {log_path}. Resume with: {resume_command(layout.root)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    code, line = _failure_line(run, record, log_path)
    log.error("%s", line)
    return code


def _consolidate(plan: LaunchPlan, job: SbatchJob, steps: _Steps) -> Optional[int]:
    """The consolidation job: the EMA's first (it never removes the shards), the model's, then its card."""
    for cons in [*job.before_argvs, job.argv]:
        argv = _this_python(cons)
        log.info("[fsdp_workflow] consolidating: %s", shown(argv))
        rc = steps.run(argv)
        stopped = _stopped(rc)
        if stopped:
            print(f"[fsdp_workflow] {stopped[1]} while consolidating (exit {stopped[0]}); the "
                  "checkpoints are untouched. Consolidate again with: "
                  f"{shell(cons)}", file=sys.stderr)
            return stopped[0]
        if rc != 0:
            log.error("[fsdp_workflow] consolidation failed (%s); the checkpoints are untouched.", _code_words(rc))
            return rc
    for card in job.after_argvs:  # the report stage: README.md (and loss_curve.png) beside the verified weights
        rc = steps.run(_this_python(card))
        if rc != 0:
            log.error("[fsdp_workflow] the model card command failed (%s); the model is verified and "
                      "in place.", _code_words(rc))
            return rc
    return None


# What this machine runs for each role of the plan's chain (the per-checkpoint eval job is Slurm's alone).
_JOB_RUNNERS: Dict[str, Callable[[LaunchPlan, SbatchJob, _Steps], Optional[int]]] = {
    Role.prepare: _prepare,
    Role.train: _train,
    Role.consolidate: _consolidate,
}


class LocalBackend:
    """This machine: the chain runs in the foreground, in order, under the run directory's lock.

    There is no queue: :meth:`states` knows no job, :meth:`cancel` has nothing to cancel
    (Ctrl-C stops a foreground run), and :meth:`live` leaves a second run to the lock.
    """

    kind = ClusterKind.local.value
    queued = False

    def issues(self, cfg: WorkflowConfig, plan: LaunchPlan) -> ValidationReport:
        return ValidationReport()

    def plan(self, cfg: WorkflowConfig, layout: RunDir) -> LaunchPlan:
        return build_plan(cfg)

    def render(self, plan: LaunchPlan) -> Dict[str, str]:
        # a local run directory holds the batch scripts too: `bash submit.sh` submits it on a cluster later
        return render_all(plan)

    def submit(self, cfg: WorkflowConfig, plan: LaunchPlan, lock: Optional[Lock] = None) -> int:
        return run_local(plan, consolidate=cfg.consolidate.enabled, lock=lock)

    def states(self, job_ids: Sequence[str]) -> Dict[str, JobState]:
        return {job_id: JobState.UNKNOWN for job_id in job_ids}

    def cancel(self, job_ids: Sequence[str]) -> None:
        return None

    def live(self, layout: RunDir) -> Optional[str]:
        return None

    def dry_run_notes(self, run_dir: str) -> List[str]:
        return []

    def submit_command(self, layout: RunDir) -> Optional[List[str]]:
        return ["bash", str(layout.script(SUBMIT_SCRIPT))]  # a local run directory holds the batch scripts too

    def job_status(self, record: RunRecord, role: str, job_id: str) -> JobStatus:
        return JobStatus(role=role, job_id=job_id, status=JobState.UNKNOWN.word,
                         source="a local run submits no jobs: this line is not its own")


BACKEND = LocalBackend()  # found by backends/registry.py
