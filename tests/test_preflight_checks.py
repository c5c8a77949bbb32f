"""The training job's preflight (fsdp_workflow/preflight.py) as two real processes on this host, without Slurm.

    python -m pytest -n 0 tests/test_preflight_checks.py

Each test plans a real run directory (``dry_run=true``, with its code snapshot), then
starts two ``python -m fsdp_workflow.preflight`` processes as Slurm would start node 0
and node 1 of a step (``SLURM_NODEID``, ``MASTER_ADDR``/``MASTER_PORT``), which meet in a
real gloo all-reduce. The test-only hook ``FSDP_WORKFLOW_TEST_PREFLIGHT=KIND@node-1``
makes node 1 lose the run directory or report another torch version. The same
failures on the two-node Slurm cluster: tests/multinode/test_preflight.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from fsdp_workflow.backends.local import free_port
from fsdp_workflow.core.exit_codes import EXIT_PREFLIGHT
from fsdp_workflow.preflight import Context, Facts, compare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A planned Slurm run (not submitted): config, scripts, provenance and the code snapshot."""
    run = tmp_path_factory.mktemp("preflight") / "run dir"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "cluster=slurm",
                           "cluster.partition=debug", f"run_dir={run}", "dry_run=true"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return run


def _two_nodes(run: Path, extra_env: Dict[str, str], port: int = 0,
               node1_env: Dict[str, str] | None = None, node1_cwd: Path | None = None) -> List[Tuple[int, str]]:
    """Node 0 and node 1 of one step, as srun starts them; (exit code, stderr) of each.

    They start in the run directory's parent: ``python -m`` puts the working directory
    first on ``sys.path``, and this checkout's package must not stand in for the snapshot.
    """
    port = port or free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_NODEID": str(node), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(run / "code"),
               "FSDP_WORKFLOW_TEST_PREFLIGHT_WAIT_S": "6", **extra_env, **((node1_env or {}) if node else {})}
        env.pop("SLURM_JOB_NODELIST", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "fsdp_workflow.preflight", str(run), "--nodes=2",
                                       "--processes-per-node=1", "--device=cpu"],
                                      env=env, stderr=subprocess.PIPE, text=True,
                                      cwd=node1_cwd if node and node1_cwd else run.parent))
    return [(p.wait(timeout=240), p.stderr.read()) for p in procs]


def test_a_good_allocation_passes_and_leaves_nothing(run_dir: Path) -> None:
    (rc0, err0), (rc1, err1) = _two_nodes(run_dir, {})
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "preflight passed on 2 node(s)" in err0 and "all-reduce" in err0
    assert "GPUs skipped (cluster.device=cpu)" in err1
    # the facts of a good preflight are removed
    assert not any((run_dir / ".preflight").rglob("node-*.json"))


def test_a_node_with_another_torch_version_is_named(run_dir: Path) -> None:
    (rc0, err0), (rc1, err1) = _two_nodes(run_dir, {"FSDP_WORKFLOW_TEST_PREFLIGHT": "version@node-1",
                                                    "SLURM_RESTART_COUNT": "3"})
    assert (rc0, rc1) == (EXIT_PREFLIGHT, EXIT_PREFLIGHT), err0 + err1
    line = next(x for x in err0.splitlines() if "preflight failed on" in x)
    assert "node 1): versions: it runs torch " in line and "+test-other-version" in line
    assert "Fix: give every node the same software" in line
    assert "preflight passed" not in err0 + err1
    # the failure's facts stay for a look: node 1's file records the odd version
    facts = json.loads((run_dir / ".preflight" / "4242.3" / "node-1.json").read_text())
    assert facts["torch"].endswith("+test-other-version")


def test_a_node_that_cannot_see_the_run_directory_is_named(run_dir: Path) -> None:
    (rc0, err0), (rc1, err1) = _two_nodes(run_dir, {"FSDP_WORKFLOW_TEST_PREFLIGHT": "no_run_dir@node-1",
                                                    "SLURM_RESTART_COUNT": "1"})
    assert (rc0, rc1) == (EXIT_PREFLIGHT, EXIT_PREFLIGHT), err0 + err1
    assert "preflight failed on" in err1 and "run directory: this node cannot write in the run directory" in err1
    assert "preflight failed on node 1: run directory: no facts from this node" in err0
    assert f"it cannot see the run directory {run_dir}" in err0
    assert "Fix: put the run directory on a filesystem every node mounts" in err0


@pytest.mark.parametrize("route", ["PYTHONPATH", "working directory"])
def test_a_node_that_imports_other_code_is_named(run_dir: Path, tmp_path: Path, route: str) -> None:
    """No hook: node 1 imports an edited copy of the package, found first on its PYTHONPATH, or in its working
    directory (``python -m`` puts it first: a job submitted from the checkout the user then edits)."""
    other = tmp_path / "edited checkout"
    shutil.copytree(run_dir / "code", other, ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "fsdp_workflow" / "preflight.py", "a") as f:
        f.write("# edited after the run was planned\n")
    restart = {"PYTHONPATH": "4", "working directory": "5"}[route]
    if route == "PYTHONPATH":
        results = _two_nodes(run_dir, {"SLURM_RESTART_COUNT": restart}, node1_env={"PYTHONPATH": str(other)})
    else:
        results = _two_nodes(run_dir, {"SLURM_RESTART_COUNT": restart}, node1_cwd=other)
    (rc0, err0), (rc1, err1) = results
    assert (rc0, rc1) == (EXIT_PREFLIGHT, EXIT_PREFLIGHT), err0 + err1
    line = next(x for x in err0.splitlines() if "preflight failed on" in x)
    assert f"node 1): code snapshot: it imports fsdp_workflow from {other / 'fsdp_workflow'} (sha256 " in line
    assert "not the code snapshot planned for this run" in line
    cwd_fix = f"Fix: the job's working directory {other} holds a copy of fsdp_workflow"
    assert (cwd_fix in line) == (route == "working directory"), line


def test_a_master_port_in_use_is_named(run_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        (rc0, err0), (rc1, err1) = _two_nodes(run_dir, {"SLURM_RESTART_COUNT": "2"}, port=port)
    assert (rc0, rc1) == (EXIT_PREFLIGHT, EXIT_PREFLIGHT), err0 + err1
    assert f"master port: MASTER_ADDR=127.0.0.1:{port}: port {port} is in use on this host" in err0
    assert "cluster.master_port_base" in err0


def _facts(node: int, **kw) -> Facts:
    base = dict(node_id=node, host=f"g{node}", package="/r/code/fsdp_workflow", code_sha256="a" * 64,
                torch="2.13.0", transformers="5.0.0", gpus=8, master_ip="10.0.0.1")
    return Facts(**{**base, **kw})


def test_compare_names_each_node_and_check(tmp_path: Path) -> None:
    """The judgement alone, on facts a GPU cluster would report (no GPU needed)."""
    ctx = Context(run_dir=tmp_path, job_id="7", restart=0, node_id=0, nodes=3, processes_per_node=8, device="cuda",
                  master_addr="g0", master_port=20007, wait_s=1, hosts=["g0", "g1", "g2"])
    found = {0: _facts(0), 1: _facts(1, gpus=4, code_sha256="b" * 64)}
    problems = {(p.node, p.check) for p in compare(ctx, found, "a" * 64)}
    assert problems == {("g1 (node 1)", "GPUs"), ("g1 (node 1)", "code snapshot"), ("g2 (node 2)", "run directory")}
    assert compare(ctx, {0: _facts(0), 1: _facts(1), 2: _facts(2)}, "a" * 64) == []
    # no snapshot planned: the nodes are compared with each other
    assert [p.check for p in compare(ctx, {0: _facts(0), 1: _facts(1), 2: _facts(2, code_sha256="c" * 64)}, None)] \
        == ["same code"]
    bad = compare(ctx, {0: _facts(0, master_ip="", master_error="gaierror: no such host"), 1: _facts(1),
                        2: _facts(2, transformers="4.0")}, "a" * 64)
    assert [(p.node, p.check) for p in bad] == [("g0 (node 0)", "master address"), ("g2 (node 2)", "versions")]
