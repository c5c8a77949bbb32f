"""Rendered job scripts: golden files per experiment, and hostile run-dir paths.

Regenerate the golden files after an intended change with:
    FSDP_WORKFLOW_REGEN_GOLDEN=1 python -m pytest tests/plan/test_render.py
and review the diff.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from fsdp_workflow.config import compose
from fsdp_workflow.backends.slurm.scripts import render_all
from fsdp_workflow.plan.render import shell_join
from fsdp_workflow.plan import spec
from fsdp_workflow.plan.spec import build_plan

from golden_files import fix_interpreter, mask_config_hash  # tests/golden_files.py

GOLDEN = Path(__file__).parent / "golden"
EXPERIMENTS = ["smoke", "llama8b_fft", "llama8b_zero3", "qwen7b_fft", "mistral7b_fft", "llama70b_tp"]
REGEN = os.environ.get("FSDP_WORKFLOW_REGEN_GOLDEN") == "1"


def _cfg(experiment: str, run_dir: str, *extra: str):
    return compose([f"+experiment={experiment}", "cluster.partition=gpu", f"run_dir='{run_dir}'", *extra])


@pytest.fixture(autouse=True)
def _fixed_interpreter(monkeypatch):
    """The scripts name the planning interpreter (sys.executable): fixed, so golden files agree on every machine."""
    fix_interpreter(monkeypatch)


VARIANTS = {"smoke_every_checkpoint": ("smoke", ["consolidate.every_checkpoint=true"]),
            # a container runtime's wrapping in every script (llama8b_fft: its paths are the same on every machine)
            "llama8b_fft_charliecloud": ("llama8b_fft", ["container=charliecloud", "container.image=/images/fsdp_workflow"]),
            "smoke_no_preflight": ("smoke", ["cluster.preflight=false"])}



@pytest.mark.parametrize("variant", EXPERIMENTS + list(VARIANTS))
def test_scripts_match_golden(variant: str) -> None:
    experiment, extra = VARIANTS.get(variant, (variant, []))
    scripts = render_all(build_plan(_cfg(experiment, f"/runs/{experiment}", *extra)))
    if variant == "smoke_every_checkpoint":
        assert {"eval.sbatch", "post_checkpoint.sh"} <= set(scripts)
    for name, text in scripts.items():
        text = mask_config_hash(text)
        path = GOLDEN / variant / name
        if REGEN:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        assert path.exists(), f"missing golden file {path}; regenerate with FSDP_WORKFLOW_REGEN_GOLDEN=1"
        assert text == path.read_text(), (
            f"{name} for {variant} differs from {path}. If the change is intended, regenerate "
            "with FSDP_WORKFLOW_REGEN_GOLDEN=1 python -m pytest tests/plan/test_render.py and review the diff."
        )


def test_scripts_check_the_planned_config_hash() -> None:
    from fsdp_workflow.config.load import to_yaml
    from fsdp_workflow.core.config_hash import config_sha256

    cfg = _cfg("smoke", "/runs/smoke")
    plan = build_plan(cfg)
    assert plan.config_sha256 == config_sha256(to_yaml(cfg))
    scripts = render_all(plan)
    for name in ("prepare.sbatch", "train.sbatch", "consolidate.sbatch"):
        assert f"CONFIG_SHA256={plan.config_sha256}\n" in scripts[name], name


def test_a_venv_without_torchrun_runs_the_launcher_module_under_its_interpreter(monkeypatch) -> None:
    """``python -m venv --system-site-packages``: torch (and its torchrun) live outside the venv's bin/,
    which is all a job's PATH is sure to hold. The launcher then runs as a module of the planning interpreter."""
    accelerate = _cfg("llama8b_fft", "/runs/x", "cluster.launcher=accelerate")
    # With the venv's own scripts (this module's fixture), the console script and its subcommand.
    node = render_all(build_plan(accelerate))["train_node.sh"]
    assert "exec accelerate launch --num_machines=2 " in node, node
    monkeypatch.setattr(spec, "beside_interpreter", lambda name: False)
    node = render_all(build_plan(_cfg("smoke", "/runs/smoke", "cluster.rank_start=exec")))["train_node.sh"]
    assert "exec /opt/venv/bin/python -m torch.distributed.run --nnodes=1 " in node, node
    # The preloaded start (a CPU run's default) never needs the console script: the interpreter runs it.
    node = render_all(build_plan(_cfg("smoke", "/runs/smoke")))["train_node.sh"]
    assert "exec /opt/venv/bin/python -m fsdp_workflow.train.node --nnodes=1 " in node, node
    node = render_all(build_plan(accelerate))["train_node.sh"]
    assert "exec /opt/venv/bin/python -m accelerate.commands.launch --num_machines=2 " in node, node
    # In an image the image's own console script runs, whatever the host's venv holds.
    cfg = _cfg("llama8b_fft", "/runs/x", "container=charliecloud", "container.image=/images/fsdp_workflow")
    assert " torchrun --nnodes=2 " in render_all(build_plan(cfg))["train_node.sh"]


def test_multinode_launch_reads_node_rank_in_the_task() -> None:
    scripts = render_all(build_plan(_cfg("llama8b_fft", "/runs/x")))
    node = scripts["train_node.sh"]
    # expanded by the per-node task, never by the batch shell
    assert '"--node_rank=${SLURM_NODEID:-0}"' in node
    assert "SLURM_NODEID" not in scripts["train.sbatch"].split("srun", 1)[0].replace("${SLURM_NODEID", "")
    sbatch = scripts["train.sbatch"]
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in sbatch
    assert "localhost" not in (sbatch + node).replace("never localhost", "")
    assert "--kill-on-bad-exit=1" in sbatch
    assert "#SBATCH --signal=USR2@300" in sbatch


def test_preflight_runs_before_the_training_step_and_a_key_turns_it_off() -> None:
    """One task per node, in the training's environment, before torchrun; exit 66 names the cause."""
    sbatch = render_all(build_plan(_cfg("llama8b_fft", "/runs/x")))["train.sbatch"]
    pre = ("if ! srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=0 /opt/venv/bin/python -m fsdp_workflow.preflight "
           "/runs/x --nodes=2 --processes-per-node=8 --device=cuda; then\n  JOB_CAUSE=preflight\n")
    assert pre in sbatch
    block = sbatch.split(pre)[1]
    assert block.index("  exit 66\nfi\n") < block.index("STARTED=") < block.index("srun --kill-on-bad-exit=1")
    assert sbatch.index("export MASTER_ADDR MASTER_PORT") < sbatch.index(pre)
    off = render_all(build_plan(_cfg("llama8b_fft", "/runs/x", "cluster.preflight=false")))["train.sbatch"]
    assert "preflight" not in off and "exit 66" not in off


def test_submit_chains_consolidation_afterok_with_kill_on_invalid_dep() -> None:
    submit = render_all(build_plan(_cfg("smoke", "/runs/x")))["submit.sh"]
    assert '"--dependency=afterok:${train_id}" --kill-on-invalid-dep=yes' in submit


@pytest.mark.parametrize("code", [
    "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "DependencyNeverSatisfied", "InvalidQOS",
    "QOSMaxWallDurationPerJobLimit", "QOSMaxCpuPerJobLimit", "AssocMaxNodePerJobLimit", "QOSMinCpuNotSatisfied",
    "QOSMaxCpuPerUserLimit", "AssocMaxJobsPerAccount", "Priority", "Resources", "Dependency", "None",
    "ReqNodeNotAvail, UnavailableNodes:n1", "BadConstraints (x)", "SomethingNew"])
def test_submit_sh_reads_pending_reasons_with_the_python_table(code: str) -> None:
    """submit.sh's own "never" test gives, for each reason, what ``backends.slurm.reasons.explain`` gives the Python route."""
    from fsdp_workflow.backends.slurm.reasons import explain

    submit = render_all(build_plan(_cfg("smoke", "/runs/x")))["submit.sh"]
    start = submit.index("never_reason() {")
    function = submit[start:submit.index("\n}\n", start) + 3]
    proc = subprocess.run(["bash", "-c", function + 'never_reason "$1"', "submit.sh", code],
                          capture_output=True, text=True, timeout=10)
    want = explain(code)
    assert (proc.returncode == 0) == want.never, (code, proc)
    if want.never:
        assert proc.stdout == f"{want.words}; fix: {want.fix}\n"


def test_no_consolidation_job_when_disabled() -> None:
    scripts = render_all(build_plan(_cfg("smoke", "/runs/x", "consolidate.enabled=false")))
    assert "consolidate.sbatch" not in scripts
    assert "afterok:${train_id}" not in scripts["submit.sh"]


def test_prepare_heads_the_chain_and_synthetic_data_needs_none() -> None:
    scripts = render_all(build_plan(_cfg("smoke", "/runs/x")))
    assert "\n/opt/venv/bin/python -m fsdp_workflow.data.prepare /runs/x\n" in scripts["prepare.sbatch"]
    submit = scripts["submit.sh"]
    assert submit.index("prepare.sbatch") < submit.index("train.sbatch") < submit.index("consolidate.sbatch")
    assert '"--dependency=afterok:${prepare_id}" --kill-on-invalid-dep=yes' in submit
    synthetic = render_all(build_plan(_cfg("smoke", "/runs/x", "data=synthetic")))
    assert "prepare.sbatch" not in synthetic and "prepare" not in synthetic["submit.sh"]


def test_unsafe_sbatch_value_is_refused_with_the_key() -> None:
    with pytest.raises(ValueError, match=r"cluster.account"):
        build_plan(_cfg("smoke", "/runs/x", "cluster.account='a b'"))


def _fake_bin(tmp: Path, name: str) -> Path:
    """A stand-in that records its argv as JSON (only to check quoting of what bash passes)."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / name
    exe.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"open(os.environ['ARGV_LOG'], 'a').write(json.dumps([{name!r}] + sys.argv[1:]) + '\\n')\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bindir


def test_hostile_run_dir_reaches_the_launcher_as_one_argument(weird_dir: Path, tmp_path: Path) -> None:
    from fsdp_workflow.backends.registry import backend_for
    from fsdp_workflow.plan.run_dir import write_run_dir

    cfg = compose(["+experiment=smoke", "cluster.rank_start=exec"])  # torchrun, found on PATH: the fake
    cfg.run_dir = str(weird_dir)  # set directly: Hydra's override grammar has no newline escape
    plan = write_run_dir(cfg, backend_for(cfg))
    for script in ("train_node.sh", "train.sbatch", "submit.sh", "consolidate.sbatch"):
        res = subprocess.run(["bash", "-n", str(weird_dir / script)], capture_output=True, text=True)
        assert res.returncode == 0, f"{script}: {res.stderr}"
    log = tmp_path / "argv.jsonl"
    env = dict(os.environ, PATH=f"{_fake_bin(tmp_path, 'torchrun')}:{os.environ['PATH']}",
               ARGV_LOG=str(log), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", SLURM_NODEID="0")
    res = subprocess.run(["bash", str(weird_dir / "train_node.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    argv = json.loads(log.read_text().splitlines()[0])
    assert argv[-1] == str(plan.run_dir)
    assert "--node_rank=0" in argv and "--master_addr=127.0.0.1" in argv and "--master_port=29999" in argv


def test_shell_join_quotes_config_values() -> None:
    assert shell_join(["echo", "a;b", "$(id)"]) == "echo 'a;b' '$(id)'"


def test_site_modules_and_env_script_are_quoted_in_every_job() -> None:
    cfg = _cfg("smoke", "/runs/x", "cluster.modules=[cuda/12.4,'nccl;id']",
               "cluster.env_script='/opt/my env/activate'", "consolidate.every_checkpoint=true")
    scripts = render_all(build_plan(cfg))
    for name in ("train.sbatch", "consolidate.sbatch", "eval.sbatch"):
        text = scripts[name]
        assert "module load cuda/12.4\nmodule load 'nccl;id'\n. '/opt/my env/activate'\n" in text, name
        # the site environment comes before the step runs
        assert text.index("module load cuda/12.4") < text.index("\n/opt/venv/bin/python " if name != "train.sbatch" else "\nsrun ")


def test_sweep_points_get_job_names_of_their_own(tmp_path) -> None:
    """Point N of a sweep (listed in its parent's sweep.json) names its jobs NAME-N-ROLE; squeue tells them apart."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"points": [
        {"num": n, "overrides": [], "run_dir": str(sweep / str(n))} for n in (0, 1)]}))
    scripts = render_all(build_plan(_cfg("smoke", str(sweep / "1"), "consolidate.every_checkpoint=true")))
    for name, role in (("prepare.sbatch", "prepare"), ("train.sbatch", "train"),
                       ("consolidate.sbatch", "consolidate"), ("eval.sbatch", "eval")):
        assert f"#SBATCH --job-name=smoke-1-{role}\n" in scripts[name], name
    alone = render_all(build_plan(_cfg("smoke", str(tmp_path / "alone"))))
    assert "#SBATCH --job-name=smoke-train\n" in alone["train.sbatch"]


def test_every_job_checks_the_config_hash_and_records_its_exit_first() -> None:
    """Before the site environment or the step: the exit record's trap, then the config.yaml hash check."""
    import hashlib

    from fsdp_workflow.config.load import to_yaml

    cfg = _cfg("smoke", "/runs/x", "consolidate.every_checkpoint=true")
    digest = hashlib.sha256(to_yaml(cfg).encode()).hexdigest()
    scripts = render_all(build_plan(cfg))
    for name in ("prepare.sbatch", "train.sbatch", "consolidate.sbatch", "eval.sbatch"):
        text = scripts[name]
        assert f"CONFIG_SHA256={digest}\n" in text, name
        trap, check = text.index("trap job_exit_record EXIT"), text.index('if [ "$(sha256sum < "$RUN_DIR/config.yaml"')
        first_step = min(i for i in (text.find("export PATH="), text.find("\nsrun "), text.find("/opt/venv/bin/python "))
                         if i >= 0)
        assert trap < check < first_step, name


def test_cpu_jobs_remove_their_staging_and_record_their_exit_on_every_way_out(tmp_path) -> None:
    """consolidate.sbatch and eval.sbatch run by bash (no Slurm), their step failing (the interpreter
    is missing): the consolidation's .hf_model.tmp-* and the evaluation's pending link are gone, and each
    left its exit record; an edited config.yaml stops a job before its step with cause config_changed."""
    from fsdp_workflow.backends.registry import backend_for
    from fsdp_workflow.plan.run_dir import write_run_dir

    run = tmp_path / "run dir"
    cfg = _cfg("smoke", str(run), "consolidate.every_checkpoint=true", "cluster=slurm")
    plan = write_run_dir(cfg, backend_for(cfg))
    layout = plan.layout
    debris = [run / ".hf_model.tmp-4242", run / ".hf_model_ema.tmp-7"]
    for d in debris:
        (d / "part").mkdir(parents=True)
    layout.eval_snapshot(5).mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77"}
    cons = subprocess.run(["bash", str(run / "consolidate.sbatch")], env=env, capture_output=True, text=True)
    assert cons.returncode == 127, cons.stderr  # /opt/venv/bin/python: not here
    assert not any(d.exists() for d in debris)
    assert json.loads((run / "job_exits" / "consolidate-77.json").read_text())["exit_code"] == 127
    ev = subprocess.run(["bash", str(run / "eval.sbatch"), "5"], env={**env, "SLURM_JOB_ID": "78"},
                        capture_output=True, text=True)
    assert ev.returncode == 127 and not layout.eval_snapshot(5).exists()
    assert json.loads((run / "job_exits" / "eval-78.json").read_text())["exit_code"] == 127
    layout.config.write_text(layout.config.read_text() + "\n# edited\n")
    edited = subprocess.run(["bash", str(run / "prepare.sbatch")], env={**env, "SLURM_JOB_ID": "79"},
                            capture_output=True, text=True)
    assert edited.returncode == 2 and "config.yaml changed since planning" in edited.stderr
    assert json.loads((run / "job_exits" / "prepare-79.json").read_text())["cause"] == "config_changed"
