"""Every failed job says why (its exit record and its log's line), held jobs show their hold, --watch ends.

On the real local Slurm. The failing job is the data preparation (``cluster.modules`` names a
module system the test node lacks: exit 127 before Python starts), so nothing trains.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]


def _status(run_dir, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_job_that_died_before_python_names_its_error_line(slurm_cluster, tmp_path):
    run_dir = tmp_path / "exit 127"
    proc = ph.run_cli(run_dir, "cluster.modules=[nosuchmodule]", "name=rec127")
    assert proc.returncode == 0, proc.stderr
    ids = ph.jobs(run_dir)
    try:
        prep = su.wait_for_job(ids["prepare"], timeout_s=120)
        assert (prep["JobState"], prep["ExitCode"]) == ("FAILED", "127:0"), prep
        for role in ("train", "consolidate"):
            su.wait_for_job(ids[role], timeout_s=60)
    finally:
        ph.cancel_unfinished(ids)
    record = json.loads((run_dir / "job_exits" / f"prepare-{ids['prepare']}.json").read_text())
    assert record["exit_code"] == 127 and record["role"] == "prepare"
    st = _status(run_dir)
    assert st.returncode == 0, st.stderr
    lines = st.stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.strip().startswith(f"prepare {ids['prepare']}".replace(" ", "")) or
             (line.split()[:2] == ["prepare", str(ids["prepare"])]))
    block = "\n".join(lines[i:i + 5])
    assert "why: exit 127: module was not found" in block, st.stdout
    assert "log says:" in block and "module: command not found" in block
    assert "fix: load it in the job: cluster.modules or cluster.env_script" in block
    assert "a job this one waits for failed or was cancelled" in st.stdout  # the chain's cancelled jobs
    js = json.loads(_status(run_dir, "--json").stdout)
    prep_json = next(j for j in js["jobs"] if j["role"] == "prepare")
    assert prep_json["why"]["exit_code"] == 127 and prep_json["why"]["source"] == "record"
    assert js["chain"] == "failed"
    # --watch ends on a chain that has ended, with its exit code
    watch = _status(run_dir, "--watch", "0.5", timeout=30)
    assert watch.returncode == 127, watch.stdout[-2000:]
    assert "the chain has ended: exit 127" in watch.stdout


def test_a_held_job_shows_its_hold_and_no_eta(slurm_cluster, tmp_path):
    run_dir = tmp_path / "held"
    # begin=now+120: the job is still pending when the test holds it, however quick the scheduler
    assert ph.run_cli(run_dir, "dry_run=true", "data=synthetic", "name=held1",
                      "+cluster.additional_parameters.begin=now+120").returncode == 0
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 2.0, "time": 1000.0 + s}) + "\n" for s in range(1, 11)))
    sub = subprocess.run(["bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    ids = ph.jobs(run_dir)
    try:
        su._run(["scontrol", "uhold", str(ids["train"])])  # a user hold (JobHeldUser)
        su.wait_for_state(ids["train"], {"PENDING"}, timeout_s=30)
        st = _status(run_dir)
        assert f"scontrol release {ids['train']}" in st.stdout, st.stdout
        row = next(line for line in st.stdout.splitlines() if line.split()[:2] == ["train", str(ids["train"])])
        assert " held " in row, row
        assert "eta" not in st.stdout.lower(), st.stdout
        js = json.loads(_status(run_dir, "--json").stdout)
        assert js["progress"]["eta_s"] is None and js["chain"] == "queued"
        # held by the user: the watch keeps watching (the job can still start); it ends once cancelled
        su._run(["scancel", str(ids["train"])])
        su.wait_for_job(ids["train"], timeout_s=60)
        su.wait_for_job(ids["consolidate"], timeout_s=60)
        watch = _status(run_dir, "--watch", "0.5", timeout=30)
        assert watch.returncode == 1, watch.stdout[-2000:]
        assert "cancelled; no checkpoint reached" in watch.stdout
    finally:
        ph.cancel_unfinished(ids)
