"""``python -m fsdp_workflow ARGS`` for tests, forked from an interpreter that has already imported it.

Hundreds of tests run the command to prove what it prints and how it exits (dry runs,
refused configs). A fresh interpreter spends about a third of such a call importing
Hydra, OmegaConf and NumPy; on the suite's two CPUs that was minutes. Here one server
process per test process imports the command's modules once, and each call is a
``fork()`` of it that then runs the command exactly as ``python -m`` does
(``runpy.run_module(..., run_name="__main__")``: the module body executes afresh, so
no state of an earlier call is shared), with its own working directory, environment,
``sys.argv`` and stdout/stderr, and exits through the normal interpreter shutdown
(atexit and logging flushed). The caller gets a ``subprocess.CompletedProcess`` as from
``subprocess.run``.

What a fork cannot reproduce is the interpreter's start: ``PYTHON*`` variables that
act at startup (``PYTHONPATH``, ``PYTHONSAFEPATH``, ...), and which modules a fresh
process imports. Calls whose environment changes such a variable, and tests about
startup itself (``tests/cli/test_main.py::test_planning_imports_neither_torch_nor_transformers``),
run a real ``subprocess`` instead; :func:`run` falls back to one on its own.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

_SERVER = r'''
import importlib, json, os, runpy, sys
import fsdp_workflow.__main__  # noqa: F401  the command's modules (Hydra, OmegaConf, the schema), once
del sys.modules["fsdp_workflow.__main__"]  # each call runs it afresh, as `python -m` does
# What a plan imports on first use (validation, planning, Hydra's launcher and config sources): a
# fifth of a forked call's CPU when each call imported them again. Imported before any call, so
# every call still starts from the same state.
for name in %(WARM)r:
    importlib.import_module(name)

def serve():
    proto_in = os.fdopen(os.dup(0), "r")
    proto_out = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDONLY)
    for line in proto_in:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the call: becomes `python -m fsdp_workflow ARGS`
            proto_in.close(); proto_out.close()
            os.dup2(devnull, 0)
            out = os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC)
            err = os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC)
            os.dup2(out, 1); os.dup2(err, 2)
            os.chdir(req["cwd"])
            os.environ.clear(); os.environ.update(req["env"])
            sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
            sys.argv = ["fsdp_workflow", *req["argv"]]
            runpy.run_module("fsdp_workflow", run_name="__main__", alter_sys=True)
            return
        _, status = os.waitpid(pid, 0)
        proto_out.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        proto_out.flush()

serve()
'''

WARM = (
    "fsdp_workflow.config.validate", "fsdp_workflow.config.hydra_mode", "fsdp_workflow.config.keys",
    "fsdp_workflow.plan.checks", "fsdp_workflow.plan.run_dir", "fsdp_workflow.plan.spec", "fsdp_workflow.plan.estimate",
    "fsdp_workflow.launch.pipeline", "fsdp_workflow.backends.registry", "fsdp_workflow.backends.local",
    "fsdp_workflow.backends.torchrun_io", "fsdp_workflow.backends.slurm.backend", "fsdp_workflow.backends.slurm.submit",
    "fsdp_workflow.backends.slurm.scripts", "fsdp_workflow.backends.slurm.pending", "fsdp_workflow.backends.slurm.reasons",
    "fsdp_workflow.backends.slurm.status_jobs", "fsdp_workflow.backends.slurm.live_chain",
    "fsdp_workflow.backends.slurm.cluster_check", "fsdp_workflow.core.lock", "fsdp_workflow.core.logs",
    "fsdp_workflow.data.sources", "fsdp_workflow.data.summary",
    "hydra._internal.core_plugins.basic_launcher", "hydra._internal.core_plugins.basic_sweeper",
    "hydra._internal.core_plugins.file_config_source", "hydra._internal.core_plugins.structured_config_source",
    "hydra._internal.core_plugins.importlib_resources_config_source", "hydra._internal.core_plugins.bash_completion",
    "hydra._internal.core_plugins.fish_completion", "hydra._internal.core_plugins.zsh_completion",
    "hydra._internal.logging_config", "omegaconf._impl", "antlr4.LL1Analyzer", "difflib", "gzip", "pty",
    "subprocess",
)
_SERVER = _SERVER % {"WARM": WARM}

_STARTUP_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONSTARTUP",
                 "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONHASHSEED")

_lock = threading.Lock()
_server: Optional[subprocess.Popen] = None


def _start() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def run(args: Sequence[str], cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, fsdp_workflow, *args], cwd=cwd, env=env, capture_output=True, text=True)``.

    ``timeout`` is the caller's bound on the call: past it the call is killed (as
    ``subprocess.run`` would) and :class:`subprocess.TimeoutExpired` raised.
    """
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-m", "fsdp_workflow", *args]
    if any(env.get(v) != os.environ.get(v) for v in _STARTUP_VARS):  # acts at startup: a real process
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with _lock, tempfile.TemporaryDirectory(prefix="forked-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch(), err.touch()
        server = _start()
        request = {"argv": list(args), "cwd": str(cwd or ROOT), "env": env, "stdout": str(out), "stderr": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply: list = []
        reader = threading.Thread(target=lambda: reply.append(server.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not reply or not reply[0]:
            os.killpg(server.pid, signal.SIGKILL)  # the call is in the server's process group: it goes too
            server.wait()  # the next call starts a new server
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        code = json.loads(reply[0])["returncode"]
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())
