"""Charliecloud (``container=charliecloud``): the smoke chain and a probe step in real ``ch-run`` containers.

The image is a directory built here: a skeleton root (its own ``/etc``, ``/tmp``,
``/bin -> usr/bin``...) with the bind destinations the run needs, into which the
host's ``/usr`` and Python prefix are bound (``container.binds``) standing in for an
image's userland and its Python with torch. Everything else the step sees comes
through the binds the wrapper derives from the config. Needs ``ch-run`` (Debian's
``charliecloud-runtime``, 0.31): installed with apt-get when the tests run as root,
as tools/slurm/local_cluster.sh installs Slurm (skip that with FSDP_WORKFLOW_SKIP_APT=1).
The argument lists themselves are golden files (tests/container/golden/charliecloud-*.txt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from fsdp_workflow.core.roles import Role
from fsdp_workflow.config import compose
from fsdp_workflow.container import EnvFilter, RUNTIMES, bind_list
from fsdp_workflow.plan.checks import check as validate
from fsdp_workflow.plan.render import env_filter_program
from fsdp_workflow.backends.registry import backend_for
from fsdp_workflow.plan.run_dir import write_run_dir
from fsdp_workflow.plan.spec import wrap_argv

APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
PROBE = r"""
import json, os, sys
from fsdp_workflow.config.load import load_run_config
cfg = load_run_config(sys.argv[1])
json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "data": open(cfg.data.path).read(),
           "host_etc": os.path.exists("/etc/os-release")}, open(os.path.join(cfg.run_dir, "probe.json"), "w"))
"""


def _install_ch_run() -> Optional[str]:
    """``ch-run``, installed with apt-get if missing and allowed (root, FSDP_WORKFLOW_SKIP_APT unset)."""
    if shutil.which("ch-run") or os.geteuid() != 0 or not shutil.which("apt-get") \
            or os.environ.get("FSDP_WORKFLOW_SKIP_APT") == "1":
        return shutil.which("ch-run")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "charliecloud-runtime"]
    if subprocess.run(install, env=APT_ENV, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update"], env=APT_ENV, capture_output=True, timeout=600)
        subprocess.run(install, env=APT_ENV, capture_output=True, timeout=600)
    return shutil.which("ch-run")


def _host_env(**extra: str) -> Dict[str, str]:
    """A host environment as a user's shell has it (ch-run needs USER), plus what a test adds."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.setdefault("USER", "root" if os.geteuid() == 0 else str(os.geteuid()))
    env.update(extra)
    return env


def _stand_in_binds() -> List[str]:
    """The host's userland and Python (with torch), bound into the skeleton image in place of its own."""
    return sorted({"/usr", os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)})


def _charliecloud(image: Path, run_dir: Path, *extra: str):
    python_bin = os.path.dirname(sys.executable)
    binds = ",".join(_stand_in_binds())
    return compose(["+experiment=smoke", "cluster=local", "container=charliecloud", f"container.image={image}",
                    f"container.binds=[{binds}]", f"+container.env.PATH={python_bin}:/usr/bin:/bin",
                    f"run_dir={run_dir}", *extra])


def build_image(image: Path, cfg) -> None:
    """A skeleton root with a destination for every bind of ``cfg`` (what the validation's fix asks for)."""
    for d in ("dev", "proc", "sys", "tmp", "usr", "etc", "root"):
        (image / d).mkdir(parents=True, exist_ok=True)
    for name in ("passwd", "group", "hosts", "resolv.conf"):
        (image / "etc" / name).touch()
    for d in ("bin", "lib", "lib64", "sbin"):
        if not (image / d).is_symlink():
            (image / d).symlink_to(f"usr/{d}")
    for b in bind_list(cfg):
        inside = image / b.dst.lstrip("/")
        if os.path.isfile(b.src):
            inside.parent.mkdir(parents=True, exist_ok=True)
            inside.touch()
        elif not b.dst.startswith("/tmp/"):
            inside.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def ch_run() -> str:
    path = _install_ch_run()
    if not path:
        pytest.skip("needs ch-run (apt-get install charliecloud-runtime); tests that install it run as root")
    return path


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A directory outside /tmp: ch-run shares the host's /tmp, so only paths elsewhere prove a bind matters."""
    path = Path(tempfile.mkdtemp(prefix="fsdp-ch-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- real ch-run
@pytest.mark.slow  # a whole chain: its module is handed out with the long groups (tests/conftest.py)
def test_smoke_chain_trains_and_consolidates_in_charliecloud(ch_run: str, tmp_path: Path) -> None:
    image, run_dir = tmp_path / "image", tmp_path / "run"
    overrides = ["train.max_steps=10", "checkpoint.every_steps=10"]
    build_image(image, _charliecloud(image, run_dir, *overrides))
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "cluster=local", "container=charliecloud",
         f"container.image={image}", f"container.binds=[{','.join(_stand_in_binds())}]",
         f"+container.env.PATH={os.path.dirname(sys.executable)}:/usr/bin:/bin", f"run_dir={run_dir}", *overrides],
        env=_host_env(PYTHONPATH=os.environ.get("PYTHONPATH", "")), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ch-run" in (run_dir / "train_node.sh").read_text()
    assert (run_dir / "hf_model" / "model.safetensors").is_file()
    assert "Consolidated, verified model" in proc.stdout


@pytest.fixture
def probe_job(ch_run: str, tmp_path: Path, outside_tmp: Path):
    """A written run directory whose data lives outside /tmp, and its image."""
    data = outside_tmp / "corpus.txt"
    data.write_text("hello from the bound data\n" * 50)
    image, run_dir = tmp_path / "image", tmp_path / "run"
    cfg = _charliecloud(image, run_dir, f"data.path={data}")
    build_image(image, cfg)
    write_run_dir(cfg, backend_for(cfg))
    env = _host_env(SLURM_JOB_ID="4242", NCCL_SOCKET_IFNAME="ib0", SECRET_TOKEN="do-not-leak",
                    PYTHONPATH=str(outside_tmp), HOME=str(outside_tmp))
    return cfg, run_dir, data, env


def _run(argv: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_step_runs_in_the_image_with_only_the_pass_through_environment(probe_job) -> None:
    cfg, run_dir, data, env = probe_job
    proc = _run(wrap_argv(cfg, ["python", "-c", PROBE, str(run_dir)], Role.consolidate), env)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads((run_dir / "probe.json").read_text())
    inside = probe["env"]
    assert "CH_RUNNING" in inside  # set by ch-run: the step ran in a Charliecloud container
    assert probe["host_etc"] is False and Path("/etc/os-release").exists()  # the image's /etc, not the host's
    assert probe["data"] == data.read_text() and probe["cwd"] == str(run_dir)
    assert inside["SLURM_JOB_ID"] == "4242" and inside["NCCL_SOCKET_IFNAME"] == "ib0"
    assert inside["PYTHONPATH"] == str(run_dir / "code") and inside["PYTHONNOUSERSITE"] == "1"
    assert "SECRET_TOKEN" not in inside and "HOME" not in inside


def test_without_its_bind_the_step_sees_the_image_not_the_host(probe_job) -> None:
    """Drop the data's ``-b``: the step reads the image's empty placeholder, never the host's file."""
    cfg, run_dir, data, env = probe_job
    argv = wrap_argv(cfg, ["python", "-c", PROBE, str(run_dir)], Role.consolidate)
    i = argv.index(str(data))
    assert argv[i - 1] == "-b"
    proc = _run(argv[: i - 1] + argv[i + 1:], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run_dir / "probe.json").read_text())["data"] == ""


# ---------------------------------------------------------------- without ch-run
def test_missing_bind_destination_in_the_image_is_a_config_error(tmp_path: Path, outside_tmp: Path) -> None:
    image, run_dir = tmp_path / "image", tmp_path / "run"
    (image / "usr").mkdir(parents=True)
    data = outside_tmp / "corpus.txt"
    data.write_text("x\n")
    report = validate(_charliecloud(image, run_dir, f"data.path={data}"))
    issue = next(i for i in report.errors if i.key == "data.path")
    assert "exists in the image" in issue.why and f"touch {image}{data}" in issue.fix
    dry = validate(_charliecloud(image, run_dir, f"data.path={data}", "dry_run=true"))
    assert "data.path" not in dry.keys() and "data.path" in [w.key for w in dry.warnings]
    writable = validate(_charliecloud(image, run_dir, f"data.path={data}", "container.extra_args=[-w]"))
    assert "data.path" not in writable.keys()
    read_only = validate(_charliecloud(image, run_dir, "container.binds=[/usr,/opt:/opt:ro]", "dry_run=true"))
    assert [w.value for w in read_only.warnings if "no read-only bind" in w.why] == ["/opt:/opt:ro"]
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "container=charliecloud",
                           f"container.image={image}", f"data.path={data}", f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "mkdir -p" in proc.stderr and not run_dir.exists()


def test_relative_image_and_colon_paths_are_refused(tmp_path: Path) -> None:
    report = validate(compose(["+experiment=smoke", "container=charliecloud", "container.image=images/fw",
                               f"run_dir='{tmp_path}/a:b'"]))
    assert "container.image" in report.keys()
    assert "ch-run -b" in next(i for i in report.errors if i.key == "run_dir").why
    # a comma is fine for ch-run (each -b is one argument), unlike Apptainer's --bind list
    ok = validate(compose(["+experiment=smoke", "container=charliecloud", f"container.image={tmp_path}",
                           f"run_dir='{tmp_path}/a,b'", "dry_run=true"]))
    assert "run_dir" not in ok.keys()


def test_env_filter_keeps_only_pass_through_variables() -> None:
    """The constant program, run for real with `env` standing in for ch-run."""
    program = env_filter_program(RUNTIMES["charliecloud"].env_filter or EnvFilter())
    host = {"PATH": os.environ["PATH"], "USER": "u", "SLURM_JOB_ID": "42", "MASTER_ADDR": "n1", "RANK": "3",
            "PYTHONPATH": "/home/u/evil", "SECRET_TOKEN": "x", "HOME": "/home/u", "LD_PRELOAD": "/x.so",
            "SLURM_JOB_NAME": "name with 'quotes' and\nnewline"}
    out = subprocess.run(["bash", "-c", program, "x", "env", "-0"], env=host,
                         capture_output=True, text=True, check=True).stdout
    env = dict(kv.split("=", 1) for kv in out.split("\0") if kv)
    for name in ("_", "SHLVL"):  # bash sets these itself for the command it execs
        env.pop(name, None)
    assert env == {k: host[k] for k in ("PATH", "USER", "SLURM_JOB_ID", "MASTER_ADDR", "RANK", "SLURM_JOB_NAME")}
