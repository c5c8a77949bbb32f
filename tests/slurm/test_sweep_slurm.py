"""A Hydra multirun sweep on the real local Slurm: one whole chain per point, an index, status over it.

    python -m pytest tests/slurm/test_sweep_slurm.py

``python -m fsdp_workflow -m ... optimizer.lr=A,B run_dir=SWEEP`` validates both
points, then submits prepare -> train -> consolidate for each, in ``SWEEP/0`` and
``SWEEP/1``; ``SWEEP/sweep.json`` maps each point's overrides to its run dir and
job ids; ``python -m fsdp_workflow.status SWEEP`` prints one line per point and
marks the one with the lowest eval loss.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pipeline_helpers as ph
import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]

# Short chains: the two points' jobs share the test node. The in-loop eval gives each point an eval loss.
SHORT = ["train.max_steps=6", "checkpoint.every_steps=6", "train.eval_every_steps=3", "train.eval_batches=2"]


def test_a_two_point_sweep_submits_two_chains_indexed_and_shown(slurm_cluster, tmp_path):
    sweep = tmp_path / "lr sweep"
    argv = [sys.executable, "-m", "fsdp_workflow", "-m", "+experiment=smoke", *ph.SMOKE, f"run_dir={sweep}",
            *SHORT, "optimizer.lr=1e-3,3e-3"]
    proc = subprocess.run(argv, cwd=ph.ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    index = json.loads((sweep / "sweep.json").read_text())
    points = index["points"]
    assert [(p["num"], p["run_dir"], p["exit_code"]) for p in points] == [(0, str(sweep / "0"), 0),
                                                                          (1, str(sweep / "1"), 0)]
    assert ["optimizer.lr=0.001" in p["overrides"] for p in points] == [True, False]
    assert ["optimizer.lr=0.003" in p["overrides"] for p in points] == [False, True]
    ids = [ph.jobs(sweep / str(n)) for n in (0, 1)]
    try:
        for p, own in zip(points, ids):
            assert set(own) == {"prepare", "train", "consolidate"}
            assert p["jobs"] == {role: str(job) for role, job in own.items()}  # the index holds the same ids
        assert not set(ids[0].values()) & set(ids[1].values())
        # each point's jobs have a name of their own: the sweep's name and the point's number
        names = [{role: su.show_job(job)["JobName"] for role, job in own.items()} for own in ids]
        assert names == [{role: f"smoke-{n}-{role}" for role in own} for n, own in enumerate(ids)], names
        for n, own in enumerate(ids):
            cons = su.wait_for_job(own["consolidate"], timeout_s=240)
            assert cons["JobState"] == "COMPLETED", (cons, ph.logs(sweep / str(n)))
            assert json.loads((sweep / str(n) / "hf_model" / "verification.json").read_text())["ok"] is True
    finally:
        for own in ids:
            ph.cancel_unfinished(own)
    assert [("lr: 0.001" in (sweep / "0" / "config.yaml").read_text()),
            ("lr: 0.003" in (sweep / "1" / "config.yaml").read_text())] == [True, True]

    st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(sweep), "--json"],
                        capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    rows = json.loads(st.stdout)
    evals = [[m["eval_loss"] for m in ph.metrics(sweep / str(n)) if "eval_loss" in m][-1] for n in (0, 1)]
    losses = [ph.metrics(sweep / str(n))[-1]["loss"] for n in (0, 1)]
    assert [(r["num"], r["state"], r["step"], r["max_steps"]) for r in rows] == [(0, "done", 6, 6), (1, "done", 6, 6)]
    assert [r["loss"] for r in rows] == losses and [r["eval_loss"] for r in rows] == evals
    assert [r["best"] for r in rows] == [evals[0] < evals[1], evals[1] <= evals[0]]
    text = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(sweep)],
                          capture_output=True, text=True, timeout=60).stdout
    best = 0 if evals[0] < evals[1] else 1
    lines = {int(line.split()[0]): line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert lines[best].endswith("<- best") and not lines[1 - best].endswith("<- best"), text
    assert "optimizer.lr" in text.splitlines()[1] and lines[0].split()[1] == "0.001", text  # the swept key's column
    assert "done" in lines[0] and "6/6" in lines[0], text


def test_a_point_sbatch_refuses_does_not_stop_the_next_from_submitting(slurm_cluster, tmp_path):
    """Point 0 asks more memory than any node (sbatch refuses it, exit 2); point 1 is still submitted."""
    sweep = tmp_path / "mem sweep"
    argv = [sys.executable, "-m", "fsdp_workflow", "-m", "+experiment=smoke", *ph.SMOKE, "data=synthetic",
            "name=refsweep", "cluster.check_limits=false", f"run_dir={sweep}", "cluster.mem_gb=100000,4"]
    proc = subprocess.run(argv, cwd=ph.ROOT, capture_output=True, text=True, timeout=180)
    submitted = ph.jobs(sweep / "1") if (sweep / "1" / "jobs.txt").exists() else {}
    try:
        assert proc.returncode == 2, proc.stderr + proc.stdout
        assert "cluster.mem_gb = 100000" in proc.stderr and "sbatch refused the training job" in proc.stderr
        assert set(submitted) == {"train", "consolidate"}, proc.stderr  # data=synthetic: no prepare job
        index = json.loads((sweep / "sweep.json").read_text())
        assert [(p["num"], p["exit_code"], p["jobs"]) for p in index["points"]] == [
            (0, 2, {}), (1, 0, {role: str(job) for role, job in submitted.items()})]
        assert not (sweep / "0" / "jobs.txt").exists()
        assert "sweep: 2 of 2 points ran: 1 finished, 1 exited 2" in proc.stderr, proc.stderr
        st = subprocess.run([sys.executable, "-m", "fsdp_workflow.status", str(sweep), "--json"],
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        states = [r["state"] for r in json.loads(st.stdout)]
        assert states[0] == "refused (2)" and states[1] not in ("planned", "refused (2)"), states
    finally:
        ph.cancel_unfinished(submitted)
