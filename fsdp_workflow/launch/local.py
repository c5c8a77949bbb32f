"""Run a plan on this machine: data preparation, the node script under torchrun, then consolidation.

The same ``train_node.sh`` that Slurm runs on each node runs here, with the
rendezvous on 127.0.0.1 and a free port, so a local smoke run exercises the
exact launch a cluster job would.

Signals: SIGUSR2, SIGTERM or SIGINT sent to ``python -m fsdp_workflow`` go to
the process group of ``train_node.sh``, which has become torchrun (``exec``).
torchrun starts every rank in a session of its own and re-sends the signal to
each (``train_node.sh`` exports ``PET_SIGNALS_TO_HANDLE``); on SIGUSR2/SIGTERM
the ranks checkpoint and rank 0 writes ``RUN_DIR/.requeue``. The command then
exits 75 and prints how to resume.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from typing import List, Optional

from fsdp_workflow.core.exit_codes import EXIT_REQUEUE
from fsdp_workflow.core.lock import Lock
from fsdp_workflow.core.rundir import TRAIN_NODE_SCRIPT
from fsdp_workflow.plan.jobs import LaunchPlan

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: List[str], env: dict) -> int:
    """Run a child in its own process group; forward SIGINT/SIGTERM/SIGUSR2 to all of it.

    The group is the launcher only: torchrun's ranks live in sessions of their own
    and get the signal from torchrun.
    """
    proc = subprocess.Popen(argv, env=env, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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


def _this_python(argv: List[str]) -> List[str]:
    """A ``python -m ...`` step run by this interpreter: the same environment as the trainer's."""
    return [sys.executable, *argv[1:]] if argv[:1] == ["python"] else list(argv)


def run_local(plan: LaunchPlan, consolidate: bool, lock: Optional[Lock] = None) -> int:
    """Train, then consolidate. Returns the exit code for the CLI."""
    layout = plan.layout
    env = _as_if_activated(dict(os.environ))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    if plan.code_dir is not None:  # the code as planned (cluster.code_snapshot), as the Slurm jobs run it
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plan.code_dir), env.get("PYTHONPATH")]))
    env.update(plan.nccl_env)
    # A marker left by an earlier preempted run in this directory would turn a later
    # failure into "stopped on a signal"; train.sbatch removes it the same way.
    layout.requeue_marker.unlink(missing_ok=True)
    if plan.prepare_argv:
        log.info("[fsdp_workflow] preparing the data (tokenise, mask, pack once)")
        rc = _run(_this_python(plan.prepare_argv), env)
        if rc != 0:
            log.error("[fsdp_workflow] data preparation failed (exit code %s); nothing was trained.", rc)
            return rc
    log.info("[fsdp_workflow] training: %s, metrics in %s", layout.logs, layout.metrics)
    rc = _run(["bash", str(layout.script(TRAIN_NODE_SCRIPT))], env)
    if rc != 0:
        if layout.requeue_marker.exists():
            log.warning("[fsdp_workflow] training stopped on a signal after saving a checkpoint; rerun the same "
                        "command with checkpoint.resume=auto run_dir=%s to continue.", layout.root)
            return EXIT_REQUEUE
        log.error("[fsdp_workflow] training failed (exit code %s); consolidation skipped.", rc)
        return rc
    if not consolidate or not plan.consolidate_argv:
        log.info("[fsdp_workflow] done; checkpoints in %s", layout.checkpoints)
        return 0
    # The EMA first (train.ema_decay): the model's consolidation may remove the shards.
    for cons in filter(None, (plan.consolidate_ema_argv, plan.consolidate_argv)):
        argv = _this_python(cons)
        log.info("[fsdp_workflow] consolidating: %s", " ".join(argv[1:]))
        rc = _run(argv, env)
        if rc != 0:
            log.error("[fsdp_workflow] consolidation failed (exit code %s); the checkpoints are untouched.", rc)
            return rc
    out = str(layout.hf_model)
    print(f"[fsdp_workflow] done. Consolidated, verified model: {out}")
    if plan.consolidate_ema_argv:
        print(f"  and its EMA: {layout.hf_model_ema}")
    print(f"  load it with: AutoModelForCausalLM.from_pretrained({out!r})")
    return 0
