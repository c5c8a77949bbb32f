"""Why each job ended, from its exit record and its log, when Slurm no longer says (no cluster needed).

The run directories are written as the job scripts write them: ``jobs.txt``, the
``job_exits/<role>-<id>.json`` record of the EXIT trap, the job's log. The job ids are
ones no Slurm knows, which is what ``status`` sees once slurmctld (MinJobAge) and
accounting forgot a job.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


from fsdp_workflow.core.job_exit import explain, first_error_line
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.report.status.collect import chain_outcome, collect
from fsdp_workflow.report.status.sweep_status import collect_sweep, format_sweep
from fsdp_workflow.report.status.text import format_text
from .fixtures import config_yaml

GONE = ["990000001", "990000002", "990000003"]  # ids no cluster knows


def _run(root: Path) -> RunDir:
    run = RunDir(root)
    root.mkdir(parents=True)
    run.config.write_text(config_yaml(run.root, "cluster.kind=slurm", "train.max_steps=30"))
    run.logs.mkdir()
    return run


def _job(run: RunDir, role: str, job_id: str, code: int, log: str, cause: str = "") -> None:
    with open(run.jobs, "a") as f:
        f.write(f"{role} {job_id}\n")
    run.job_exits.mkdir(exist_ok=True)
    run.job_exit(role, job_id).write_text(json.dumps(
        {"role": role, "job_id": job_id, "exit_code": code, "cause": cause, "restart": 0, "time": 1}))
    run.log_file(role, job_id).write_text(log)


MODULE_LOG = """[fsdp_workflow] preparing
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
ModuleNotFoundError: No module named 'omegaconf'
"""


def test_a_forgotten_failed_job_is_told_from_its_record_and_log(tmp_path):
    run = _run(tmp_path / "run")
    _job(run, "prepare", GONE[0], 1, MODULE_LOG)
    rs = collect(run.root)
    prep = rs.jobs[0]
    assert prep.status == "failed" and "job_exits" in prep.source
    assert prep.why["reason"].startswith("Python could not import omegaconf")
    assert prep.why["line"] == "ModuleNotFoundError: No module named 'omegaconf'"
    text = format_text(rs)
    assert "why: exit 1: Python could not import omegaconf" in text
    assert "log says: ModuleNotFoundError: No module named 'omegaconf'" in text
    assert "fix: plan again from the environment that has it" in text
    assert chain_outcome(rs) == ("failed", 1)


def test_known_causes_name_the_line_and_the_fix(tmp_path):
    bad = explain({"exit_code": 2}, "", None, tmp_path)  # no log: the code's meaning
    assert bad is not None and bad.reason == "refused: bad config or arguments"
    log = tmp_path / "x.out"
    log.write_text("loading\nprepare: 1 bad record(s):\n  /data/bad.jsonl:51: not JSON\n")
    why = explain({"exit_code": 2}, "2:0", log, tmp_path)
    assert why.reason == "bad input at /data/bad.jsonl:51" and why.line == "/data/bad.jsonl:51: not JSON"
    log.write_text("error: /r/hf_model: output path already exists; choose a new OUT or delete it first\n")
    why = explain(None, "2:0", log, tmp_path)
    assert "/r/hf_model exists already" in why.reason and "mv /r/hf_model /r/hf_model.old" in why.fix
    log.write_text("/spool/slurm_script: line 30: apptainer: command not found\n")
    why = explain({"exit_code": 127}, "", log, tmp_path)
    assert why.reason == "apptainer was not found on the node's PATH" and "cluster.modules" in why.fix
    why = explain(None, "0:9", None, tmp_path)  # killed before it wrote anything
    assert why.reason == "killed by SIGKILL" and "cluster.mem_gb" in why.fix
    assert explain({"exit_code": 0}, "0:0", None, tmp_path) is None
    assert first_error_line(["srun: error: vm: task 0: Exited with exit code 1", "RuntimeError: boom"]) == \
        "RuntimeError: boom"


def test_an_edited_config_is_said_and_its_job_says_why(tmp_path):
    run = _run(tmp_path / "run")
    run.provenance.write_text(json.dumps({"config_sha256": hashlib.sha256(b"planned").hexdigest()}))
    _job(run, "train", GONE[1], 2, "[fsdp_workflow] training job 1: config.yaml changed since planning\n",
         cause="config_changed")
    text = format_text(collect(run.root))
    assert "warning: config.yaml changed since planning" in text
    assert "why: exit 2: config.yaml changed since planning" in text
    assert f"python -m fsdp_workflow.replan {run.root}" in text


def test_staging_left_behind_is_listed(tmp_path):
    run = _run(tmp_path / "run")
    debris = [run.root / ".hf_model.tmp-4242", run.code / ".fsdp_workflow.tmp", run.eval_snapshot(10)]
    for d in debris:
        d.mkdir(parents=True)
    (run.code / "fsdp_workflow").mkdir()
    rs = collect(run.root)
    assert sorted(rs.debris) == sorted(map(str, debris))
    text = format_text(rs)
    assert all(f"left behind: {d}" in text for d in debris)


def test_a_sweep_point_keeps_its_last_known_state(tmp_path):
    sweep = tmp_path / "sweep"
    a, b = _run(sweep / "0"), _run(sweep / "1")
    _job(a, "prepare", GONE[0], 0, "")
    _job(a, "train", GONE[1], 0, "")
    _job(a, "consolidate", GONE[2], 0, "")
    _job(b, "prepare", GONE[0], 2, "prepare: /d/bad.jsonl:3: unknown role 'narrator'\n")
    (sweep / "sweep.json").write_text(json.dumps({"points": [
        {"num": 0, "overrides": ["optimizer.lr=1"], "run_dir": str(a.root), "jobs": {}},
        {"num": 1, "overrides": ["optimizer.lr=2"], "run_dir": str(b.root), "jobs": {}}]}))
    points = collect_sweep(sweep)
    assert [p.state for p in points] == ["done", "failed (prepare)"]
    assert "failed (prepare)" in format_sweep(sweep, points)
