"""A real step in a namespace holding only the bound paths (bubblewrap stands in for Apptainer).

The wrapped command from :func:`fsdp_workflow.plan.spec.wrap_argv` runs unchanged: the
constant pass-through program filters the host environment, then ``apptainer exec`` is
``tests/container/fake_apptainer.py``, which builds a bubblewrap namespace from the same
``--bind`` list (plus read-only /usr, /lib*, /bin, /etc, the Python prefix and the
project, standing in for the image). The step loads the run directory's config through
the project's loader, reads the training data and the model directory, and writes into
the run directory. Dropping one bind makes it fail as it would on a cluster.
Needs the ``bubblewrap`` Debian package (installed by tools/install.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_workflow.core.roles import Role
from fsdp_workflow.config import compose
from fsdp_workflow.plan.spec import wrap_argv
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.plan.run_dir import write_run_dir

FAKE = Path(__file__).with_name("fake_apptainer.py")

PROBE = r"""
import json, os, site, sys
from fsdp_workflow.config.load import load_run_config
cfg = load_run_config(sys.argv[1])
text = open(cfg.data.path).read()
files = os.listdir(cfg.model.name_or_path)
try:
    open(os.path.join(cfg.model.name_or_path, "scribble"), "w")
    model_writable = True
except OSError:
    model_writable = False
json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "data": text, "model_files": files,
           "model_writable": model_writable, "user_site": site.ENABLE_USER_SITE},
          open(os.path.join(cfg.run_dir, "probe.json"), "w"))
"""


def _bwrap_works() -> bool:
    if not shutil.which("bwrap"):
        return False
    probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "true"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _bwrap_works(), reason="needs bubblewrap (apt-get install bubblewrap) "
                                "and user namespaces; tools/install.sh installs it")


@pytest.fixture
def job(tmp_path: Path):
    """A run dir (hostile name), data and model dirs outside it, a fake image, a fake apptainer on PATH."""
    run_dir = tmp_path / "run dir;'x'"
    data = tmp_path / "data set" / "corpus.txt"
    model = tmp_path / "model"
    for d in (data.parent, model, tmp_path / "not bound", tmp_path / "bin"):
        d.mkdir(parents=True)
    data.write_text("hello from the bound data\n")
    (model / "config.json").write_text("{}")
    (tmp_path / "not bound" / "secret.txt").write_text("host only")
    image = tmp_path / "fsdp_workflow.sif"
    image.write_text("stand-in image")
    apptainer = tmp_path / "bin" / "apptainer"
    apptainer.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    apptainer.chmod(0o755)
    cfg = compose(["+experiment=smoke", "container=apptainer", f"container.image={image}",
                   f"data.path='{data}'", f"model.name_or_path={model}", "cluster.device=cpu",
                   f'run_dir="{run_dir}"'])
    write_run_dir(cfg, backend_for(cfg))
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "NCCL_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "node1", "PYTHONPATH": str(tmp_path / "not bound"),
           "SECRET_TOKEN": "do-not-leak", "APPTAINERENV_SNEAKY": "1", "HOME": str(tmp_path / "not bound")}
    return cfg, run_dir, data, env


def _run(argv, env):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_step_runs_with_only_its_binds(job) -> None:
    cfg, run_dir, data, env = job
    argv = wrap_argv(cfg, ["python", "-c", PROBE, str(run_dir)], Role.consolidate)
    proc = _run(argv, env)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads((run_dir / "probe.json").read_text())
    assert probe["data"] == data.read_text() and probe["model_files"] == ["config.json"]
    assert probe["cwd"] == str(run_dir)
    assert not probe["model_writable"]  # inputs are bound read-only
    inside = probe["env"]
    # pass-through variables cross, explicit ones are set, everything else stays outside
    assert inside["SLURM_JOB_ID"] == "4242" and inside["NCCL_SOCKET_IFNAME"] == "ib0"
    assert inside["MASTER_ADDR"] == "node1"
    assert inside["PYTHONNOUSERSITE"] == "1" and probe["user_site"] is False
    assert inside["XDG_CACHE_HOME"] == str(run_dir / ".cache")
    # the host's PYTHONPATH stays outside; inside, the run's code snapshot comes first (cluster.code_snapshot)
    assert inside["PYTHONPATH"] == str(run_dir / "code")
    for leaked in ("SECRET_TOKEN", "SNEAKY", "HOME"):
        assert leaked not in inside, leaked


def test_unbound_host_paths_do_not_exist_inside(job, tmp_path: Path) -> None:
    cfg, run_dir, _, env = job
    check = f"import os, sys; sys.exit(os.path.exists({str(tmp_path / 'not bound')!r}))"
    assert _run(wrap_argv(cfg, ["python", "-c", check], Role.eval), env).returncode == 0


def test_dropping_a_bind_fails_like_on_a_cluster(job) -> None:
    cfg, run_dir, data, env = job
    argv = wrap_argv(cfg, ["python", "-c", PROBE, str(run_dir)], Role.consolidate)
    i = argv.index(next(a for a in argv if a.startswith(str(data))))
    assert argv[i - 1] == "--bind"
    proc = _run(argv[: i - 1] + argv[i + 1:], env)
    assert proc.returncode != 0
    assert "FileNotFoundError" in proc.stderr and str(data) in proc.stderr
    assert not (run_dir / "probe.json").exists()


def test_missing_bind_source_stops_before_the_step(job, tmp_path: Path) -> None:
    cfg, run_dir, _, env = job
    argv = wrap_argv(cfg, ["python", "-c", PROBE, str(run_dir)], Role.consolidate)
    i = argv.index("--bind")
    argv[i + 1:i + 1] = [str(tmp_path / "gone"), "--bind"]
    proc = _run(argv, env)
    assert proc.returncode == 255 and "mount source" in proc.stderr
