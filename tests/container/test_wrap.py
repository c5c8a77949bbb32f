"""Container wrapping: golden commands per runtime x strategy, env/bind/--nv policy, validation.

Regenerate the golden files after an intended change with:
    FSDP_WORKFLOW_REGEN_GOLDEN=1 python -m pytest tests/container/test_wrap.py
and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fsdp_workflow.core.roles import Role
from fsdp_workflow.config import compose
from fsdp_workflow.container import RUNTIMES, EnvFilter, bind_list, bind_paths, srun_container_args
from fsdp_workflow.plan.checks import check as validate
from fsdp_workflow.backends.slurm.scripts import render_all
from fsdp_workflow.plan.render import env_filter_program
from fsdp_workflow.plan.spec import build_plan, wrap_argv

from golden_files import fix_interpreter, mask_config_hash  # tests/golden_files.py

PASS_ENV_PROGRAM = env_filter_program(EnvFilter())

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("FSDP_WORKFLOW_REGEN_GOLDEN") == "1"
STRATEGIES = ["fsdp2", "fsdp1", "ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"]
IMAGES = {"none": None, "apptainer": "/images/fsdp_workflow.sif", "pyxis": "nvcr.io#nvidia/pytorch:25.01-py3",
          "charliecloud": "/images/fsdp_workflow"}
# The golden files' section names -> the role each wraps (their headers predate Role.eval; kept byte-identical).
STEPS = {"train": Role.train, "consolidate": Role.consolidate, "evaluate": Role.eval}


@pytest.fixture
def fixed_interpreter(monkeypatch):
    """Without an image the scripts name the planning interpreter (sys.executable): fixed for the golden files."""
    fix_interpreter(monkeypatch)


def _cfg(runtime: str, *extra: str, strategy: str = "fsdp2", run_dir: str = "/runs/x"):
    ov = ["+experiment=llama8b_fft", "cluster.partition=gpu", f"strategy={strategy}", f"container={runtime}",
          f"run_dir='{run_dir}'"]
    if IMAGES[runtime]:
        ov.append(f"container.image='{IMAGES[runtime]}'")
    return compose(ov + list(extra))


def _record(cfg) -> str:
    """Every wrapped step command, the srun container options, and every rendered script."""
    parts = []
    for name, step in STEPS.items():
        parts.append(f"### wrap_argv {name}\n" + json.dumps(wrap_argv(cfg, ["CMD", "ARG"], step), indent=1))
        parts.append(f"### srun_container_args {name}\n" + json.dumps(srun_container_args(cfg, step), indent=1))
    for name, text in sorted(render_all(build_plan(cfg)).items()):
        parts.append(f"### {name}\n{text}")
    return "\n".join(parts)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("runtime", list(IMAGES))
def test_commands_and_scripts_match_golden(runtime: str, strategy: str, fixed_interpreter) -> None:
    text = mask_config_hash(_record(_cfg(runtime, strategy=strategy)))
    path = GOLDEN / f"{runtime}-{strategy}.txt"
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; regenerate with FSDP_WORKFLOW_REGEN_GOLDEN=1"
    assert text == path.read_text(), (
        f"container commands for {runtime}/{strategy} differ from {path}. If intended, regenerate with "
        "FSDP_WORKFLOW_REGEN_GOLDEN=1 python -m pytest tests/container/test_wrap.py and review the diff."
    )


def test_apptainer_gpu_only_for_training_on_cuda() -> None:
    cuda = _cfg("apptainer")
    assert "--nv" in wrap_argv(cuda, ["x"], Role.train)
    assert "--nv" not in wrap_argv(cuda, ["x"], Role.consolidate)
    assert "--nv" not in wrap_argv(cuda, ["x"], Role.eval)
    cpu = _cfg("apptainer", "cluster.device=cpu")
    assert "--nv" not in wrap_argv(cpu, ["x"], Role.train)


def test_pyxis_cpu_steps_disable_the_gpu_hook() -> None:
    cfg = _cfg("pyxis")
    assert "--export=ALL,NVIDIA_VISIBLE_DEVICES=void" not in srun_container_args(cfg, Role.train)
    for step in (Role.consolidate, Role.eval):
        args = srun_container_args(cfg, step)
        assert "--export=ALL,NVIDIA_VISIBLE_DEVICES=void" in args
        assert any(a.startswith("--container-env=") and "NVIDIA_VISIBLE_DEVICES" in a for a in args)


def test_unknown_step_is_refused() -> None:
    """One word per role: the evaluation job's step is ``eval``, as its role; ``evaluate`` is no step."""
    with pytest.raises(ValueError, match="'evaluate'; expected one of prepare, train, consolidate, eval$"):
        wrap_argv(_cfg("apptainer"), ["x"], "evaluate")


def test_apptainer_environment_is_controlled() -> None:
    cfg = _cfg("apptainer", "+container.env.MY_FLAG='a,b c'")
    argv = wrap_argv(cfg, ["CMD"], Role.train)
    assert argv[:5] == ["bash", "-c", PASS_ENV_PROGRAM, "fsdp_workflow-container-env", "apptainer"]
    assert "--cleanenv" in argv and "--no-home" in argv
    inside = argv[argv.index("/images/fsdp_workflow.sif") + 1:]
    assert inside[0] == "env" and inside[-1] == "CMD"
    # explicit values travel as one argv element each: commas and spaces survive
    assert "MY_FLAG=a,b c" in inside and "PYTHONNOUSERSITE=1" in inside
    assert "XDG_CACHE_HOME=/runs/x/.cache" in inside


def test_pass_through_program_filters_the_host_environment(tmp_path: Path) -> None:
    """Run the constant program for real, with `env` standing in for apptainer."""
    import subprocess

    host = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "42", "NCCL_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "n1",
            "CUDA_VISIBLE_DEVICES": "0,1", "ACCELERATE_USE_FSDP": "true", "PYTHONPATH": "/home/u/evil",
            "SECRET_TOKEN": "x", "APPTAINERENV_LEAK": "1", "RANK": "3", "WEIRD_VAL": "a b"}
    host["SLURM_JOB_NAME"] = "name with 'quotes' and\nnewline"
    out = subprocess.run(["bash", "-c", PASS_ENV_PROGRAM, "x", "env", "-0"], env=host,
                         capture_output=True, text=True, check=True).stdout
    env = dict(kv.split("=", 1) for kv in out.split("\0") if kv)
    passed = {k[len("APPTAINERENV_"):]: v for k, v in env.items() if k.startswith("APPTAINERENV_")}
    assert passed == {"SLURM_JOB_ID": "42", "NCCL_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "n1",
                      "CUDA_VISIBLE_DEVICES": "0,1", "ACCELERATE_USE_FSDP": "true", "RANK": "3",
                      "SLURM_JOB_NAME": host["SLURM_JOB_NAME"]}


def test_pyxis_unsets_host_python_and_mounts_read_only_inputs() -> None:
    cfg = _cfg("pyxis")
    inside = wrap_argv(cfg, ["CMD"], Role.train)
    assert inside[0] == "env" and ["-u", "PYTHONPATH"] == inside[1:3] and inside[-1] == "CMD"
    mounts = next(a for a in srun_container_args(cfg, Role.train) if a.startswith("--container-mounts="))
    assert "/shared/models/Meta-Llama-3-8B:/shared/models/Meta-Llama-3-8B:ro" in mounts
    assert "/runs/x:/runs/x," in mounts + ","


def test_binds_cover_every_config_path_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _cfg("apptainer", "data.path=/shared/data/*/train-*.jsonl", "checkpoint.resume=/old/run/checkpoints/step-9",
               f"consolidate.output_dir={out}/model", "+container.env.HF_HOME=/scratch/hf",
               "container.binds=[/runs/x/sub,/opt/site:/site:ro]")
    binds = {b.key: b for b in bind_list(cfg)}
    assert binds["data.path"].src == "/shared/data"  # a glob binds the directory above its wildcard
    assert binds["checkpoint.resume"].read_only and not binds["run_dir"].read_only
    assert binds["consolidate.output_dir"].src == str(out)  # the step creates model/ itself
    assert binds["container.env.HF_HOME"].src == "/scratch/hf"
    assert RUNTIMES["apptainer"].bind_arg(binds["container.binds[1]"]) == "/opt/site:/site:ro"
    assert "container.binds[0]" not in binds  # inside the run dir already
    assert len(bind_paths(cfg)) == len(set(bind_paths(cfg)))


HOSTILE = ["with space", "quote'single", 'quote"double', "semi;colon && rm -rf x", "dollar$HOME`id`", "new\nline"]


@pytest.mark.parametrize("name", HOSTILE, ids=lambda n: n.encode("unicode_escape").decode()[:16])
def test_hostile_run_dir_is_one_bind_argument(name: str) -> None:
    run_dir = f"/runs/{name}"
    cfg = _cfg("apptainer", run_dir=run_dir.replace("'", "\\'"))
    argv = wrap_argv(cfg, ["CMD"], Role.consolidate)
    assert argv[argv.index("--pwd") + 1] == run_dir
    assert run_dir in [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert not [i for i in validate(cfg).errors if i.key == "run_dir"]


@pytest.mark.parametrize("runtime,name,bad", [("apptainer", "a,b", "','"), ("apptainer", "a:b", "':'"),
                                              ("pyxis", "a b", "whitespace"), ("pyxis", "a:b", "':'")])
def test_unbindable_paths_are_config_errors(runtime: str, name: str, bad: str) -> None:
    report = validate(_cfg(runtime, "dry_run=true", run_dir=f"/runs/{name}"))
    issue = next(i for i in report.errors if i.key == "run_dir")
    assert bad in issue.why and "symlink" in issue.fix


def test_validation_image_binds_and_gpu(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.sif")
    cfg = _cfg("apptainer", f"container.image={missing}", "container.binds=[relative/dir,/a:/b:rx]",
               "container.extra_args=[--nv]")
    report = validate(cfg)
    keys = report.keys()
    assert "container.image" in keys  # not a dry run: the image must exist
    assert "container.binds[0]" in keys and "container.binds[1]" in keys
    assert "container.extra_args" in [w.key for w in report.warnings]
    dry = validate(_cfg("apptainer", f"container.image={missing}", "dry_run=true"))
    assert "container.image" not in dry.keys() and "container.image" in [w.key for w in dry.warnings]
    pyxis = validate(_cfg("pyxis", "+container.env.NVIDIA_VISIBLE_DEVICES=void", "dry_run=true"))
    assert "container.env.NVIDIA_VISIBLE_DEVICES" in pyxis.keys()


def test_cli_reports_container_errors_with_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_workflow", "+experiment=smoke", "container=apptainer",
         f"container.image={tmp_path}/missing.sif", "container.binds=[rel]", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "container.image" in proc.stderr and "container.binds[0]" in proc.stderr
    assert not run_dir.exists()
