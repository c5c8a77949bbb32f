"""``fsdp_workflow.submit``: the CLI's chain, submitted from Python, as submitit job handles.

    python -m pytest -n 0 tests/slurm/test_api.py

On the real local Slurm: the smoke chain goes through the API and completes while
the test waits on its handles; a second chain is cancelled through them and leaves
nothing queued; an invalid config raises the CLI's message (exit code 2) before
anything is written or submitted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List

import pytest
import submitit

import fsdp_workflow
import pipeline_helpers as ph
import slurm_utils as su
from fsdp_workflow.backends.slurm.handles import ChainJob

SHORT = ["train.max_steps=4", "checkpoint.every_steps=2"]


def _overrides(run_dir: Path, *extra: str) -> List[str]:
    return ["+experiment=smoke", *ph.SMOKE, f"run_dir={run_dir}", *SHORT, *extra]


def _listed(ids: Iterable[int]) -> Dict[int, str]:
    """Those of ``ids`` that squeue still lists (pending, running, completing), with their state code."""
    ids = set(ids)
    rows = (line.split() for line in su._run(["squeue", "-h", "-o", "%i %t"]).stdout.splitlines())
    return {int(i): state for i, state in rows if int(i) in ids}


def _queued(ids: Iterable[int]) -> List[int]:
    return sorted(_listed(ids))


def _still_queued_after(ids: Iterable[int], timeout_s: float = 30.0) -> List[int]:
    """Those of ``ids`` squeue still lists after ``timeout_s``.

    Slurm calls a cancelled running job CANCELLED at once, but lists it as completing
    (``CG``) until its processes are gone: that, and only that, may take a moment.
    """
    deadline = time.monotonic() + timeout_s
    while (left := _listed(ids)) and time.monotonic() < deadline:
        assert set(left.values()) <= {"CG"}, left  # cancelled: nothing pending or running any more
        time.sleep(0.5)
    return sorted(left)


def _queued_named(name: str) -> List[str]:
    """Jobs squeue lists for the run named ``name`` (the jobs are named ``<name>-<role>``)."""
    return [n for n in su._run(["squeue", "-h", "-o", "%j"]).stdout.split() if n.startswith(f"{name}-")]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submit_returns_submitit_handles_that_wait_for_the_chain(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "api run"  # a space: every path travels quoted
    chain = fsdp_workflow.submit(_overrides(run_dir, "name=api1"))
    ids = {job.role: int(job.job_id) for job in chain}
    try:
        assert chain.roles == ["prepare", "train", "consolidate"]
        assert all(isinstance(job, submitit.SlurmJob) for job in chain)
        assert ph.jobs(run_dir) == ids  # recorded in jobs.txt, as the CLI records its chain
        # One renderer: what Slurm holds for each job is the run directory's batch script.
        ph.assert_batch_scripts_recorded(run_dir, ids)
        assert chain["train"].paths.submission_file == run_dir / "train.sbatch"
        states = chain.wait()
    finally:
        ph.cancel_unfinished(ids)
    assert states == {"prepare": "COMPLETED", "train": "COMPLETED", "consolidate": "COMPLETED"}, ph.logs(run_dir)
    assert chain.done() and chain.states == states
    assert {role: su.job_state(i) for role, i in ids.items()} == states  # Slurm's own record agrees
    train = chain["train"]
    assert train.paths.stdout == run_dir / "logs" / f"train-{train.job_id}.out"
    assert train.stdout() == train.paths.stdout.read_text() and f"train job {train.job_id}" in train.stdout()
    # The training job's preflight passed on the node, before torchrun started (the failures:
    # tests/slurm/test_preflight_slurm.py and tests/multinode/test_preflight.py).
    log, host = train.stdout(), socket.gethostname().split(".")[0]
    assert f"preflight {host} (node 0): run directory ok" in log and "preflight passed on 1 node(s)" in log, log
    assert log.index("preflight passed") < log.index("node_rank 0 of 1")
    assert chain["consolidate"].result() is None and chain["consolidate"].exception() is None
    ph.load_consolidated(run_dir / "hf_model")
    # provenance.json names the CLI command that plans this run (resume commands are built from it).
    command = json.loads((run_dir / "provenance.json").read_text())["command"]
    assert command[0].endswith("__main__.py") and "experiment=smoke" in command, command


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_cancel_stops_a_chain_and_leaves_nothing_queued(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "cancelled"
    chain = fsdp_workflow.submit(_overrides(run_dir, "name=api_cancel"))
    ids = {job.role: int(job.job_id) for job in chain}
    try:
        assert _queued(ids.values()), "the chain was never queued"
        chain.cancel()
        states = chain.wait()
    finally:
        ph.cancel_unfinished(ids)
    assert all(s.startswith("CANCELLED") for s in states.values()), states
    assert _still_queued_after(ids.values()) == []
    assert chain.done()
    err = chain["train"].exception()
    assert isinstance(err, submitit.core.utils.FailedJobError) and "CANCELLED" in str(err), err
    with pytest.raises(submitit.core.utils.FailedJobError):
        chain["consolidate"].result()


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_an_invalid_config_raises_the_clis_message_and_submits_nothing(slurm_cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "bad"
    bad = ["name=api_bad", "train.max_stepz=3", "train.max_steps=-3"]
    with pytest.raises(fsdp_workflow.SubmitError) as caught:
        fsdp_workflow.submit(_overrides(run_dir, *bad))
    err = caught.value
    assert err.exit_code == 2
    assert [i.key for i in err.issues] == ["train.max_stepz", "train.max_steps"], err.issues
    assert str(err).startswith("fsdp_workflow: invalid config\nfound 2 problems"), str(err)
    assert not run_dir.exists() and _queued_named("api_bad") == []
    cli = ph.run_cli(run_dir, *SHORT, *bad)
    assert cli.returncode == 2 and str(err) in cli.stderr, (str(err), cli.stderr)


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_handle_follows_its_job_where_sacct_has_no_accounting(slurm_cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Clusters without accounting: sacct answers an error, and the handle asks scontrol instead.

    This cluster keeps accounting, so a ``sacct`` first on PATH answers as such a cluster's
    does (NOTES.md: "accounting storage is disabled"); everything else is the real Slurm.
    """
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (fake / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    log = tmp_path / "job.out"
    job_id = su._run(["sbatch", "--parsable", "-p", "debug", "-o", str(log), "--wrap", "echo handle-ok"]).stdout.strip()
    job = ChainJob(tmp_path, job_id, role="probe", log=log, script=tmp_path / "none.sbatch")
    deadline = time.monotonic() + 90
    while not job.done() and time.monotonic() < deadline:
        time.sleep(1)
    assert job.done(), f"job {job_id}: state {job.state!r} (Slurm: {su.job_state(job_id)})"
    assert job.state == "COMPLETED" and job.stdout() == "handle-ok\n", (job.state, job.stdout())


def test_what_the_api_refuses_without_a_cluster(tmp_path: Path) -> None:
    """No run_dir, a local cluster, a dry run, a flag: refused with the key and the fix; nothing written."""
    with pytest.raises(fsdp_workflow.SubmitError) as no_dir:
        fsdp_workflow.submit(["+experiment=smoke", *ph.SMOKE])
    assert no_dir.value.exit_code == 2 and "run_dir = null" in str(no_dir.value) and "pass run_dir=DIR" in str(no_dir.value)
    run_dir = tmp_path / "local"
    with pytest.raises(fsdp_workflow.SubmitError) as local:
        fsdp_workflow.submit(["+experiment=smoke", f"run_dir={run_dir}", "dry_run=true"])
    assert [i.key for i in local.value.issues] == ["cluster.kind", "dry_run"], str(local.value)
    assert "add cluster=slurm" in str(local.value)
    with pytest.raises(fsdp_workflow.SubmitError, match="takes overrides, not command-line flags"):
        fsdp_workflow.submit(["-m", "+experiment=smoke", *ph.SMOKE, f"run_dir={run_dir}"])
    assert not run_dir.exists()


def test_import_fsdp_workflow_stays_light_and_exports_the_api() -> None:
    """``fsdp_workflow.submit`` loads the API on first use; a bare import pulls in no Hydra or submitit."""
    code = ("import sys, fsdp_workflow; assert not {'hydra', 'submitit'} & set(sys.modules), sorted(sys.modules); "
            "from fsdp_workflow import submit, Chain, SubmitError; print(submit.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "fsdp_workflow.api", proc.stderr
    assert issubclass(ChainJob, submitit.SlurmJob)
