"""``pip install .`` is an ordinary package: the config tree and smoke corpus travel in it.

The checkout holds one config tree, the top-level ``conf/``; ``fsdp_workflow/conf``
is a relative link to it (pyproject.toml says why). A wheel built offline from a copy
of the checkout carries every file of the tree as package data; a fresh venv gets a
regular install of that wheel, and its ``fsdp-workflow`` runs from an unrelated
directory: composing the smoke experiment, a dry run, a user experiment found through
``hydra.searchpath``, and the real 2-process smoke run. A second venv gets an editable
install of the copy, which composes too and snapshots the tree as real files.

    python -m pytest -q tests/packaging

The venv sees the system's site-packages, so torch, transformers and Hydra come
from there and nothing is downloaded. Builds run on a copy of the source in a
temporary directory, so ``build/`` and ``*.egg-info`` never land in the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import yaml

from fsdp_workflow.config.load import CONF_DIR
from fsdp_workflow.core.rundir import (
    CONFIG_FILE,
    CONSOLIDATE_SBATCH,
    LAUNCH_ENV_FILE,
    PROVENANCE_FILE,
    SUBMIT_SCRIPT,
    TRAIN_NODE_SCRIPT,
    TRAIN_SBATCH,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fsdp_workflow"
# Everything a build reads from the checkout (pyproject's `readme` included).
BUILD_INPUTS = ("pyproject.toml", "README.md", "conf", PACKAGE)
RUN_FILES = (CONFIG_FILE, LAUNCH_ENV_FILE, TRAIN_SBATCH, TRAIN_NODE_SCRIPT, CONSOLIDATE_SBATCH, SUBMIT_SCRIPT,
             PROVENANCE_FILE)
PIP_OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check", "-q"]

# A user's experiment kept outside the package (README: hydra.searchpath): the packaged
# smoke run, shorter, with SGD.
USER_EXPERIMENT = """\
# @package _global_
defaults:
  - smoke
  - override /optimizer: sgd
  - _self_

name: my_smoke
train:
  max_steps: 6
checkpoint:
  every_steps: 3
"""


def _copy_source(dest: Path) -> Path:
    """The build inputs of the checkout, without bytecode or an editable install's egg-info.

    Links are copied as links, so the build meets ``fsdp_workflow/conf`` as a checkout has it.
    """
    dest.mkdir(parents=True)
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _env() -> Dict[str, str]:
    """This environment, minus what would point a child at the checkout or at another venv.

    PATH keeps no trace of the new venv: its console scripts are run by path, unactivated.
    """
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _run(argv: Sequence[str], cwd: Path, timeout_s: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout_s)


def _explain(res: subprocess.CompletedProcess) -> str:
    return f"exit code {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-8000:]}"


def _git_repo_with_a_commit(path: Path) -> bool:
    """Make ``path`` a repository with one commit, as a user's project holding a venv would be."""
    if shutil.which("git") is None:
        return False
    (path / "README").write_text("a user's project\n")
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "README"], ["commit", "-q", "-m", "init"]):
        subprocess.run(git + args, check=True, capture_output=True)
    return True


@dataclass
class Installed:
    venv: Path
    package_dir: Path  # fsdp_workflow/ inside the venv's site-packages
    inside_git_repo: bool

    @property
    def cli(self) -> Path:
        return self.venv / "bin" / "fsdp-workflow"


def _venv(root: Path) -> Path:
    """A venv that sees the system's site-packages, without a pip of its own.

    The system's pip (and setuptools, for an editable build) are seen through the
    system site-packages and install into this venv's prefix.
    """
    venv = root / "venv"
    res = _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=root)
    assert res.returncode == 0, _explain(res)
    probe = _run([venv / "bin" / "python", "-c", "import setuptools, torch, transformers, hydra, pip"], cwd=root)
    if probe.returncode != 0:
        pytest.skip("a --system-site-packages venv of this interpreter cannot import pip, setuptools, torch, "
                    f"transformers and hydra (is pytest running inside a venv?):\n{probe.stderr[-2000:]}")
    return venv


def _package_dir(venv: Path, cwd: Path) -> Path:
    res = _run([venv / "bin" / "python", "-c", "import fsdp_workflow; print(fsdp_workflow.__file__)"], cwd=cwd)
    assert res.returncode == 0, _explain(res)
    return Path(res.stdout.strip()).parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel`` builds, offline, from a copy of this checkout."""
    root = tmp_path_factory.mktemp("wheel")
    src = _copy_source(root / "src")
    assert (src / PACKAGE / "conf").is_symlink(), "the copy lost the link the build must follow"
    res = _run([sys.executable, "-m", "pip", "wheel", *PIP_OFFLINE, "-w", root / "dist", src], cwd=root,
               timeout_s=300)
    assert res.returncode == 0, _explain(res)
    (whl,) = (root / "dist").glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Installed:
    """A venv (inside a user's git repository) with a regular install of the wheel."""
    root = tmp_path_factory.mktemp("install")
    in_repo = _git_repo_with_a_commit(root)
    venv = _venv(root)
    res = _run([venv / "bin" / "python", "-m", "pip", "install", *PIP_OFFLINE, wheel], cwd=root, timeout_s=300)
    assert res.returncode == 0, _explain(res)
    return Installed(venv=venv, package_dir=_package_dir(venv, root), inside_git_repo=in_repo)


@dataclass
class Editable:
    venv: Path
    src: Path  # the copy of the checkout the venv's package points at


@pytest.fixture(scope="module")
def editable(tmp_path_factory: pytest.TempPathFactory) -> Editable:
    """A venv with ``pip install -e`` of a copy of this checkout (its egg-info lands in the copy)."""
    root = tmp_path_factory.mktemp("editable")
    src = _copy_source(root / "src")
    venv = _venv(root)
    res = _run([venv / "bin" / "python", "-m", "pip", "install", *PIP_OFFLINE, "-e", src], cwd=root,
               timeout_s=300)
    assert res.returncode == 0, _explain(res)
    assert _package_dir(venv, root) == src / PACKAGE, "the venv does not import the editable copy"
    return Editable(venv=venv, src=src)


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory that is neither the checkout nor holds any config."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    return d


@pytest.mark.slow
def test_the_install_is_regular_and_shadows_the_editable_checkout(installed: Installed) -> None:
    assert installed.package_dir.is_relative_to(installed.venv), installed.package_dir
    assert not installed.package_dir.is_relative_to(ROOT), "imported the checkout, not the install"
    assert (installed.package_dir / "conf" / "config.yaml").is_file()
    assert installed.cli.is_file()


@pytest.mark.slow
def test_dry_run_from_another_directory_uses_the_packaged_config(installed: Installed, elsewhere: Path,
                                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "plan"
    res = _run([installed.cli, "dry_run=true", f"run_dir={run_dir}"], cwd=elsewhere)
    assert res.returncode == 0, _explain(res)
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), f"{name} missing from the dry run"
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    corpus = installed.package_dir / "assets" / "smoke" / "corpus.txt"
    assert cfg["data"]["path"] == str(corpus) and corpus.is_file()
    prov = json.loads((run_dir / "provenance.json").read_text())
    # The venv sits in a user's repository: its revision is not the package's.
    assert prov["git_revision"] == "unknown", (prov, installed.inside_git_repo)
    assert "fatal:" not in res.stderr, res.stderr  # no noise from git either
    assert list(elsewhere.iterdir()) == [], "the command left files in the working directory"


@pytest.mark.slow
def test_a_user_experiment_outside_the_package_through_hydra_searchpath(installed: Installed, elsewhere: Path,
                                                                        tmp_path: Path) -> None:
    conf = tmp_path / "my_conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "my_smoke.yaml").write_text(USER_EXPERIMENT)
    run_dir = tmp_path / "plan"
    res = _run([installed.cli, f"hydra.searchpath=[file://{conf}]", "+experiment=my_smoke", "dry_run=true",
                f"run_dir={run_dir}"], cwd=elsewhere)
    assert res.returncode == 0, _explain(res)
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    assert cfg["name"] == "my_smoke"
    assert cfg["optimizer"]["name"] == "sgd"
    assert (cfg["train"]["max_steps"], cfg["checkpoint"]["every_steps"]) == (6, 3)
    assert cfg["cluster"]["processes_per_node"] == 2  # the rest is the packaged smoke experiment's


@pytest.mark.slow
def test_smoke_training_runs_from_the_installed_package(installed: Installed, elsewhere: Path,
                                                        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = _run([installed.cli, "+experiment=smoke", f"run_dir={run_dir}", "train.max_steps=4", "checkpoint.every_steps=2"],
               cwd=elsewhere, timeout_s=600)
    assert res.returncode == 0, _explain(res)
    hf_model = run_dir / "hf_model"
    assert (hf_model / "config.json").is_file(), _explain(res)
    assert list(hf_model.glob("*.safetensors")), sorted(p.name for p in hf_model.iterdir())
    # The ranks ran the installed package, though the venv was never activated: its code
    # snapshot (cluster.code_snapshot), copied from the installed package at planning. Each
    # rank logs the package it imported ("code: ..."), forked from the node launcher's
    # forkserver (cluster.rank_start=auto on CPU) under the venv's interpreter.
    node = (run_dir / "train_node.sh").read_text()
    assert f"exec {shlex.quote(str(installed.venv / 'bin' / 'python'))} -m fsdp_workflow.train.node " in node, node
    log = (run_dir / "logs" / "train-local.log").read_text()
    imported = re.findall(r"fsdp_workflow\.train: code: (\S+)", log)
    assert imported and all(Path(p).is_relative_to(run_dir / "code" / "fsdp_workflow") for p in imported), log[-3000:]
    snapshot = json.loads((run_dir / PROVENANCE_FILE).read_text())["code_snapshot"]
    assert Path(snapshot["source"]) == Path(installed.package_dir).resolve(), snapshot


def _yaml_files(base: Path) -> List[str]:
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*.yaml") if p.is_file())


def test_the_checkout_holds_one_config_tree() -> None:
    """conf/ is the tree; fsdp_workflow/conf is a relative link to it, tracked by git as a link."""
    assert (ROOT / "conf").is_dir() and not (ROOT / "conf").is_symlink()
    assert "config.yaml" in _yaml_files(ROOT / "conf")
    link = ROOT / PACKAGE / "conf"
    assert link.is_symlink() and os.readlink(link) == "../conf", (
        f"{link} must be the link `ln -s ../conf {link}`, not a copy of the tree")
    assert CONF_DIR == (ROOT / "conf").resolve()
    if shutil.which("git") and (ROOT / ".git").exists():
        res = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-s", f"{PACKAGE}/conf"], capture_output=True,
                             text=True, check=True)
        assert res.stdout.startswith("120000 "), f"git does not track {PACKAGE}/conf as a link: {res.stdout!r}"


def test_the_wheel_carries_every_config_file_and_asset(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        infos = zf.infolist()
    names = {i.filename for i in infos}
    expected = [f"{PACKAGE}/conf/{rel}" for rel in _yaml_files(ROOT / "conf")]
    expected += [p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE / "assets").rglob("*") if p.is_file()]
    assert f"{PACKAGE}/conf/config.yaml" in expected
    missing = sorted(set(expected) - names)
    assert not missing, (
        f"{wheel.name} lacks {missing}: widen [tool.setuptools.package-data] in pyproject.toml "
        f"so every file under conf/ (linked as {PACKAGE}/conf) and {PACKAGE}/assets is package data."
    )
    # The tree is in the wheel once, as regular files inside the package (a link would
    # point out of site-packages); no stray top-level conf/ beside the package.
    assert not [n for n in names if n.startswith("conf/")], sorted(names)[:20]
    links = [i.filename for i in infos if stat.S_ISLNK(i.external_attr >> 16)]
    assert not links, f"{wheel.name} stores links: {links}"


_COMPOSE = ("import json; from fsdp_workflow.config.load import CONF_DIR, compose; "
            "cfg = compose(['+experiment=smoke']); "
            "print(json.dumps({'conf_dir': str(CONF_DIR), 'name': cfg.name, "
            "'processes': cfg.cluster.processes_per_node}))")


def _compose_smoke(venv: Path, cwd: Path) -> Dict[str, object]:
    res = _run([venv / "bin" / "python", "-c", _COMPOSE], cwd=cwd)
    assert res.returncode == 0, _explain(res)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_wheel_install_composes_the_smoke_experiment_from_elsewhere(installed: Installed,
                                                                        elsewhere: Path) -> None:
    got = _compose_smoke(installed.venv, elsewhere)
    assert (got["name"], got["processes"]) == ("smoke", 2), got
    conf_dir = Path(str(got["conf_dir"]))
    assert conf_dir == installed.package_dir / "conf" and conf_dir.is_dir() and not conf_dir.is_symlink(), got
    assert _yaml_files(conf_dir) == _yaml_files(ROOT / "conf")


def test_the_editable_install_composes_and_snapshots_the_tree(editable: Editable, elsewhere: Path,
                                                              tmp_path: Path) -> None:
    got = _compose_smoke(editable.venv, elsewhere)
    assert (got["name"], got["processes"]) == ("smoke", 2), got
    assert Path(str(got["conf_dir"])) == editable.src / "conf", got  # the copy's one tree, not the checkout's
    # The CLI (Hydra's own search path) plans from it, and the code snapshot the jobs
    # import holds the tree itself, not a link that would dangle inside RUN_DIR/code.
    run_dir = tmp_path / "plan"
    res = _run([editable.venv / "bin" / "fsdp-workflow", "dry_run=true", f"run_dir={run_dir}"], cwd=elsewhere)
    assert res.returncode == 0, _explain(res)
    assert yaml.safe_load((run_dir / CONFIG_FILE).read_text())["name"] == "smoke"
    snap = run_dir / "code" / PACKAGE / "conf"
    assert snap.is_dir() and not snap.is_symlink(), sorted(p.name for p in (run_dir / "code" / PACKAGE).iterdir())
    assert _yaml_files(snap) == _yaml_files(ROOT / "conf")
    assert list(elsewhere.iterdir()) == [], "the command left files in the working directory"
    # This venv (--system-site-packages) has no torchrun of its own: the system's is not on a
    # job's PATH, so the node script runs the launcher module under the venv's interpreter
    # (the preloaded start, a CPU run's default, always does).
    assert not (editable.venv / "bin" / "torchrun").exists()
    node_script = (run_dir / "train_node.sh").read_text()
    assert f"exec {shlex.quote(str(editable.venv / 'bin' / 'python'))} -m fsdp_workflow.train.node " in node_script, \
        node_script
