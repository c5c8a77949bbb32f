"""Small helpers for tests that run against the real test Slurm clusters.

Every function calls the Slurm commands with argument lists (no shell) and the
current ``os.environ`` (so ``SLURM_CONF``, set per test by the conftest
fixtures, picks the cluster), unless ``env`` is given.

Import it as ``import slurm_utils`` from tests in ``tests/slurm`` (pytest puts
that directory on ``sys.path``); ``tests/multinode/conftest.py`` adds
``tests/slurm`` to ``sys.path`` so the same import works there. Both conftests
also expose the module as the ``slurm_utils`` fixture.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

#: Job states after which a job never runs again (unless requeued by hand).
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)

_FIELD_SPLIT = re.compile(r" (?=[A-Za-z][A-Za-z0-9_/:]*=)")


class SlurmError(RuntimeError):
    pass


def _run(args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60,
         check: bool = True, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout,
        env=dict(env) if env is not None else None, cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol -o show ...`` line into a dict of its Key=Value fields."""
    out: dict[str, str] = {}
    for token in _FIELD_SPLIT.split(line.strip()):
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def show_job(job_id: int | str, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """``scontrol show job`` as a dict, or None when slurmctld no longer knows the job.

    For an array or a het job only the first record is returned. ``JobState`` is
    the state ("COMPLETED"), ``Reason``, ``Restarts``, ``ExitCode``,
    ``NodeList``... are the usual scontrol fields.
    """
    proc = _run(["scontrol", "-o", "show", "job", str(job_id)], env=env, check=False)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    return parse_scontrol_record(lines[0]) if lines else None


def job_state(job_id: int | str, env: Mapping[str, str] | None = None) -> str:
    """The job's ``JobState`` from scontrol ("PENDING", "RUNNING", "COMPLETED", ...)."""
    rec = show_job(job_id, env=env)
    if rec is None:
        raise SlurmError(f"job {job_id} is unknown to slurmctld (purged after MinJobAge?)")
    return rec["JobState"]


def wait_for_state(job_id: int | str, states: Iterable[str], timeout_s: float = 120,
                   poll_s: float = 0.5, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Poll until ``JobState`` is one of ``states``; return the scontrol record."""
    wanted = set(states)
    deadline = time.monotonic() + timeout_s
    rec = None
    while True:
        rec = show_job(job_id, env=env)
        if rec is not None and rec.get("JobState") in wanted:
            return rec
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"job {job_id} not in {sorted(wanted)} after {timeout_s:.0f} s; last record: {rec}"
            )
        time.sleep(poll_s)


def wait_for_job(job_id: int | str, timeout_s: float = 120, poll_s: float = 0.5,
                 env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Wait until the job reaches a terminal state; return its final scontrol record."""
    return wait_for_state(job_id, TERMINAL_STATES, timeout_s=timeout_s, poll_s=poll_s, env=env)


def sbatch(*args: str, script: str | None = None, cwd: str | os.PathLike | None = None,
           env: Mapping[str, str] | None = None) -> int:
    """Submit with ``sbatch --parsable ARGS``; ``script`` is fed on stdin when given.

    Returns the job id. Example: ``sbatch("--wrap", "hostname", "-o", str(log))``.
    """
    proc = subprocess.run(
        ["sbatch", "--parsable", *args], input=script, capture_output=True, text=True,
        timeout=60, cwd=cwd, env=dict(env) if env is not None else None,
    )
    if proc.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
    return int(proc.stdout.strip().split(";")[0])


def scancel(job_id: int | str, env: Mapping[str, str] | None = None) -> None:
    _run(["scancel", str(job_id)], env=env)


@contextlib.contextmanager
def cancelled_on_exit(job_ids: Iterable[int | str], env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Cancel ``job_ids`` when the block ends, however it ends (best effort, errors ignored).

    A test that starts a long job (``train.max_steps=20000``) and fails before the job ends
    would otherwise leave its ranks spinning to the job's time limit, slowing every test after it.
    """
    ids = [str(j) for j in job_ids]
    try:
        yield
    finally:
        if ids:
            _run(["scancel", *ids], env=env, check=False)


def requeue(job_id: int | str, env: Mapping[str, str] | None = None) -> None:
    """``scontrol requeue``: the job goes back to PENDING, eligible only ~2 minutes later."""
    _run(["scontrol", "requeue", str(job_id)], env=env)


def release_requeued(job_id: int | str, timeout_s: float = 60,
                     env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Make a requeued job eligible now (``scontrol update JobId=N StartTime=now``).

    Waits first until the job is back to PENDING (a requeued job passes through
    COMPLETING/REQUEUED while its old run is cleaned up). Returns the record.
    """
    rec = wait_for_state(job_id, {"PENDING"}, timeout_s=timeout_s, env=env)
    # slurmd revokes the old run's credential when the job is requeued, and refuses a credential
    # issued within the same second ("Killing non-startable batch JobId=N: Job credential revoked",
    # the job then FAILED with exit 1): the new run must start at least a second later.
    time.sleep(1.5)
    _run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env)
    return rec


def exclude_nodes(job_id: int | str, nodes: Iterable[str], env: Mapping[str, str] | None = None) -> None:
    """``scontrol update JobId=N ExcNodeList=...``: a pending job will not run on these nodes."""
    _run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], env=env)


def hostnames(nodelist: str, env: Mapping[str, str] | None = None) -> list[str]:
    """``scontrol show hostnames NODELIST`` -> ["n1", "n2"]."""
    return _run(["scontrol", "show", "hostnames", nodelist], env=env).stdout.split()


def sacct_states(job_id: int | str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{JobID: State}`` from sacct for the job and its steps (needs accounting)."""
    proc = _run(["sacct", "-n", "-P", "-o", "JobID,State", "-j", str(job_id)], env=env)
    out = {}
    for line in proc.stdout.splitlines():
        if "|" in line:
            jid, state = line.split("|", 1)
            out[jid] = state.split()[0] if state else state
    return out


def wait_for_sacct_state(job_id: int | str, want: str, timeout_s: float = 30,
                         env: Mapping[str, str] | None = None) -> str:
    """The job's state in sacct once it is ``want`` (or whatever it is at the timeout).

    Accounting is written after the job ends, asynchronously: sacct may still say PENDING or
    RUNNING for a moment after scontrol says COMPLETED (seen once on CI).
    """
    deadline = time.monotonic() + timeout_s
    state = sacct_states(job_id, env=env).get(str(job_id), "")
    while state != want and time.monotonic() < deadline:
        time.sleep(0.5)
        state = sacct_states(job_id, env=env).get(str(job_id), "")
    return state


def read_log(path: str | os.PathLike, timeout_s: float = 10) -> str:
    """Read a job log, waiting a little for it to appear (slurmstepd writes it)."""
    p = Path(path)
    deadline = time.monotonic() + timeout_s
    while not p.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return p.read_text() if p.exists() else ""


# --------------------------------------------------------------------------
# Starting the clusters (used by the conftest fixtures)

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "local": REPO_ROOT / "tools" / "slurm" / "local_cluster.sh",
    "two_node": REPO_ROOT / "tools" / "slurm" / "two_node_cluster.sh",
}


class ClusterInfo:
    """What a cluster fixture yields."""

    def __init__(self, kind: str, slurm_conf: str, nodes: list[str], started_here: bool,
                 up_seconds: float):
        self.kind = kind
        self.slurm_conf = slurm_conf
        self.partition = "debug"
        self.nodes = nodes
        self.started_here = started_here
        self.up_seconds = up_seconds
        self.script = SCRIPTS[kind]

    @property
    def env(self) -> dict[str, str]:
        """``os.environ`` plus this cluster's ``SLURM_CONF``, for subprocesses."""
        return {**os.environ, "SLURM_CONF": self.slurm_conf}

    def __repr__(self) -> str:
        return (f"ClusterInfo(kind={self.kind!r}, slurm_conf={self.slurm_conf!r}, "
                f"nodes={self.nodes}, started_here={self.started_here})")


def _state_dir() -> Path:
    return Path(os.environ.get("FSDP_SLURM_STATE", "/tmp/fsdp_workflow_slurm"))


def _lease_dir(kind: str) -> Path:
    return _state_dir() / "leases" / kind


def start_cluster(kind: str) -> ClusterInfo:
    """Run ``<script> up`` (idempotent) and return the cluster's info.

    Raises ``RuntimeError`` with the script's output when it cannot start
    (not root, no apt-get, daemons failing): fixtures turn that into a test
    failure, never a skip.
    """
    script = SCRIPTS[kind]
    _state_dir().mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers start their sessions together: one brings the cluster up, the other waits.
    with open(_state_dir() / f"{kind}.start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _start_locked(kind, script)


def _run_uid() -> str:
    """This test run: the xdist run id shared by its workers, else this process."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"


def _start_locked(kind: str, script: Path) -> ClusterInfo:
    status = subprocess.run(["bash", str(script), "status"], capture_output=True, text=True, timeout=60)
    already_up = status.returncode == 0
    if not already_up and os.geteuid() != 0:
        raise RuntimeError(
            f"the {kind} Slurm test cluster is not running and cannot be started: "
            f"{script} up must run as root (it installs slurm-wlm/munge and starts slurmctld/slurmd). "
            f"Start it as root first, or run the tests as root (CI does)."
        )
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{script} up failed (exit {proc.returncode}).\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    m = re.search(r"^export SLURM_CONF=(\S+)$", proc.stdout, re.M)
    if not m:
        raise RuntimeError(f"{script} up printed no 'export SLURM_CONF=' line:\n{proc.stdout}\n{proc.stderr}")
    conf = m.group(1)
    nodes = _run(["sinfo", "-h", "-N", "-o", "%N"], env={**os.environ, "SLURM_CONF": conf}).stdout.split()
    lease = _lease_dir(kind)
    lease.mkdir(parents=True, exist_ok=True)
    (lease / str(os.getpid())).write_text(_proc_start_time(os.getpid()))
    if not already_up:
        _started_by(kind).write_text(_run_uid())
    started_here = not already_up or (_started_by(kind).exists() and _started_by(kind).read_text() == _run_uid())
    return ClusterInfo(kind, conf, sorted(set(nodes)), started_here=started_here, up_seconds=elapsed)


def _started_by(kind: str) -> Path:
    return _state_dir() / f"{kind}.started_by"


def _proc_start_time(pid: int) -> str:
    """Start time of a process (clock ticks since boot), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _lease_live(path: Path) -> bool:
    pid = int(path.name)
    if not _pid_alive(pid):
        return False
    recorded = path.read_text().strip() if path.exists() else ""
    return not recorded or recorded == _proc_start_time(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def release_cluster(info: ClusterInfo) -> None:
    """End of session: drop our lease; stop the cluster only if this test run
    (any of its xdist workers) started it, no other live pytest session holds a
    lease on it, and ``FSDP_SLURM_KEEP`` is not set."""
    lease = _lease_dir(info.kind)
    (lease / str(os.getpid())).unlink(missing_ok=True)
    others = [p for p in lease.glob("*") if p.name.isdigit() and _lease_live(p)]
    if not info.started_here or others or os.environ.get("FSDP_SLURM_KEEP"):
        return
    subprocess.run(["bash", str(info.script), "down"], capture_output=True, text=True, timeout=120)


def pickle_test_functions_by_value(module_name: str) -> None:
    """Let submitit ship functions defined in a test module.

    Test modules are not importable inside a Slurm job (the job's Python does
    not have tests/... on sys.path), so pickling a test function by reference
    fails there with ``ModuleNotFoundError``. Call
    ``pickle_test_functions_by_value(__name__)`` in the test module (or the
    test) before ``executor.submit(fn)``.
    """
    import sys

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[module_name])
