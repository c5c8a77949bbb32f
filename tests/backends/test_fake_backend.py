"""A fake scheduler behind the Backend protocol drives the real command: a dry run, a chain, and status.

Only the scheduler is faked: ``python -m fsdp_workflow`` (its ``main``, in-process) validates,
locks, plans and writes the run directory, and ``fsdp_workflow.status`` reads it back, by
their own code paths; wherever they need a scheduler they ask the registry, and get this one.

``config/schema.py``'s ``ClusterKind`` has no value for a third scheduler (and is not this
test's to change), so the fake is registered *over an existing kind*, ``slurm``, by
:func:`registered`, a context manager that puts the registry back as it was afterwards. A
run with ``cluster=slurm`` then plans, submits and reads its jobs through the fake; nothing
reaches a real Slurm (no ``sbatch`` runs, none need be installed).
"""

from __future__ import annotations

import json
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

from fsdp_workflow.backends.base import JobState, JobStatus, Role
from fsdp_workflow.backends.registry import BACKENDS, register
from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.record import RunRecord
from fsdp_workflow.config.schema import ClusterKind, WorkflowConfig
from fsdp_workflow.core.lock import Lock
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.plan.jobs import LaunchPlan
from fsdp_workflow.plan.spec import build_plan

CHAIN_FILE = "fake_chain.txt"  # what the fake renders instead of batch scripts


class FakeScheduler:
    """A queue in a dict: submit records the chain's jobs (never runs them), states answers from the dict."""

    kind = ClusterKind.slurm.value  # over an existing kind: see the module docstring
    queued = True

    def __init__(self) -> None:
        self.submitted: List[Tuple[str, str, Optional[str], List[str]]] = []  # role, id, after, argv
        self.state: Dict[str, JobState] = {}
        self.asked: List[str] = []

    def issues(self, cfg: WorkflowConfig, plan: LaunchPlan) -> ValidationReport:
        return ValidationReport()

    def plan(self, cfg: WorkflowConfig, layout: RunDir) -> LaunchPlan:
        return build_plan(cfg)

    def render(self, plan: LaunchPlan) -> Dict[str, str]:
        return {CHAIN_FILE: "".join(f"{job.role} after={job.after} {shlex.join(job.argv)}\n" for job in plan.chain)}

    def submit(self, cfg: WorkflowConfig, plan: LaunchPlan, lock: Optional[Lock] = None) -> int:
        ids: Dict[str, str] = {}
        for job in plan.chain:  # the one chain, in its order
            job_id = str(100 + len(self.submitted))
            ids[job.role] = job_id
            self.submitted.append((job.role, job_id, ids[job.after] if job.after else None, list(job.argv)))
            self.state[job_id] = JobState.PENDING
            with open(plan.layout.jobs, "a") as f:  # jobs.txt: what status reads back
                f.write(f"{job.role} {job_id}\n")
        return 0

    def states(self, job_ids: Sequence[str]) -> Dict[str, JobState]:
        self.asked += job_ids
        return {i: self.state.get(i, JobState.UNKNOWN) for i in job_ids}

    def cancel(self, job_ids: Sequence[str]) -> None:
        for i in job_ids:
            self.state[i] = JobState.CANCELLED

    def live(self, layout: RunDir) -> Optional[str]:
        live = [i for _, i in layout.submitted_jobs() if i in self.state and not self.state[i].ended]
        return f"fake jobs {', '.join(live)} of {layout.root} are still queued" if live else None

    def dry_run_notes(self, run_dir: str) -> List[str]:
        return [f"fake scheduler: nothing asked of it for {run_dir}"]

    def submit_command(self, layout: RunDir) -> Optional[List[str]]:
        return ["fake-submit", str(layout.root / CHAIN_FILE)]

    def job_status(self, record: RunRecord, role: str, job_id: str) -> JobStatus:
        state = self.states([job_id])[job_id]
        return JobStatus(role=role, job_id=job_id, status=state.word, slurm_state=state.value, source="fake")


@contextmanager
def registered(backend: FakeScheduler) -> Iterator[FakeScheduler]:
    """``backend`` in the registry (over its kind's real one) for the block; the registry as it was afterwards."""
    saved = dict(BACKENDS)
    register(backend)
    try:
        yield backend
    finally:
        BACKENDS.clear()
        BACKENDS.update(saved)


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeScheduler]:
    monkeypatch.setattr(sys, "argv", ["fsdp_workflow"])  # main() rewrites sys.argv for Hydra
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # and sets this: restored afterwards
    with registered(FakeScheduler()) as backend:
        yield backend
    assert BACKENDS[ClusterKind.slurm.value] is not backend  # the real one is back


def _plan(run: Path, *extra: str) -> None:
    """``python -m fsdp_workflow`` in this process (so it sees the registry this test changed)."""
    from fsdp_workflow.__main__ import main

    try:
        main(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={run}", *extra])
    except SystemExit as exc:
        assert exc.code in (0, None), f"python -m fsdp_workflow exited {exc.code}"


def _status(run: Path, capsys) -> dict:
    from fsdp_workflow.report.status.__main__ import main

    capsys.readouterr()
    assert main([str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_registered_replaces_and_restores_the_kinds_backend() -> None:
    real = BACKENDS[ClusterKind.slurm.value]
    with registered(FakeScheduler()) as backend:
        assert BACKENDS[ClusterKind.slurm.value] is backend
    assert BACKENDS[ClusterKind.slurm.value] is real


def test_a_dry_run_writes_what_the_fake_renders_and_submits_nothing(fake: FakeScheduler, tmp_path: Path,
                                                                    capsys) -> None:
    run = tmp_path / "run"
    _plan(run, "dry_run=true")
    out = capsys.readouterr().out
    assert "fake scheduler: nothing asked of it" in out  # the backend's own dry-run notes
    # the backend's own way to submit it later, not Slurm's submit.sh (which the fake never rendered)
    assert f"submit the same chain later with: fake-submit {run / CHAIN_FILE}" in out and "submit.sh" not in out
    chain = (run / CHAIN_FILE).read_text().splitlines()
    assert [line.split()[0] for line in chain] == [Role.prepare, Role.train, Role.consolidate]
    assert "after=train" in chain[2]
    assert not (run / "train.sbatch").exists()  # the fake renders; Slurm's renderer was not asked
    assert (run / "config.yaml").is_file() and (run / "launch.env").is_file()  # the planner's own files
    assert fake.submitted == [] and not (run / "jobs.txt").exists()


def test_the_chain_is_submitted_in_order_and_status_reads_the_fakes_states(fake: FakeScheduler, tmp_path: Path,
                                                                           capsys) -> None:
    run = tmp_path / "run"
    _plan(run)
    assert [(role, after) for role, _, after, _ in fake.submitted] == [
        (Role.prepare, None), (Role.train, "100"), (Role.consolidate, "101")]
    assert fake.submitted[0][3][-3:-1] == ["-m", "fsdp_workflow.data.prepare"]  # the plan's own argv

    assert [(j["role"], j["status"]) for j in _status(run, capsys)["jobs"]] == [
        ("prepare", "queued"), ("train", "queued"), ("consolidate", "queued")]
    fake.state.update({"100": JobState.COMPLETED, "101": JobState.RUNNING})
    jobs = _status(run, capsys)["jobs"]
    assert [(j["status"], j["slurm_state"], j["source"]) for j in jobs] == [
        ("done", "COMPLETED", "fake"), ("running", "RUNNING", "fake"), ("queued", "PENDING", "fake")]
    assert set(fake.asked) == {"100", "101", "102"}


def test_a_second_submission_is_refused_while_the_fakes_chain_is_live(fake: FakeScheduler, tmp_path: Path,
                                                                       capsys) -> None:
    """The pipeline's live-chain check asks every registered backend, the fake included."""
    run = tmp_path / "run"
    _plan(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        from fsdp_workflow.__main__ import main

        main(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", f"run_dir={run}"])
    assert exc.value.code == 2
    assert "fake jobs 100, 101, 102" in capsys.readouterr().err
    assert len(fake.submitted) == 3  # nothing submitted twice


def test_a_module_that_defines_backend_is_found_without_another_edit(tmp_path: Path, monkeypatch) -> None:
    """The registry lists no backend: a new module of the package with ``BACKEND`` is one (docs/contributing.md
    counts a backend as that module, its ``ClusterKind`` value and its conf/cluster YAML)."""
    import fsdp_workflow.backends as package
    from fsdp_workflow.backends import registry

    (tmp_path / "probe_sched.py").write_text("class Probe:\n    kind = 'probe'\n\n\nBACKEND = Probe()\n")
    (tmp_path / "no_backend_here.py").write_text("X = 1\n")
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    try:
        found = {b.kind: type(b).__name__ for b in registry._found()}
    finally:
        for name in ("probe_sched", "no_backend_here"):
            sys.modules.pop(f"fsdp_workflow.backends.{name}", None)
    assert found == {"local": "LocalBackend", "probe": "Probe", "slurm": "SlurmBackend"}, found
    assert set(BACKENDS) == {"local", "slurm"}  # the package's own, found at import
