"""The single-node test Slurm works the way the pipeline tests rely on."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

import slurm_utils as su

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

PY = sys.executable


def test_cluster_info(slurm_cluster):
    assert slurm_cluster.partition == "debug"
    assert len(slurm_cluster.nodes) == 1
    proc = su._run(["scontrol", "show", "config"])
    assert "ClusterName             = fsdplocal" in proc.stdout


def test_sbatch_final_state_from_scontrol(tmp_path):
    ok = su.sbatch("-o", str(tmp_path / "ok.out"), "--mem=100", "--wrap", "echo hello from $SLURM_JOB_ID")
    bad = su.sbatch("-o", str(tmp_path / "bad.out"), "--mem=100", "--wrap", "exit 3")
    rec = su.wait_for_job(ok, timeout_s=60)
    assert rec["JobState"] == "COMPLETED", rec
    assert rec["ExitCode"] == "0:0"
    assert f"hello from {ok}" in su.read_log(tmp_path / "ok.out")
    rec = su.wait_for_job(bad, timeout_s=60)
    assert rec["JobState"] == "FAILED", rec
    assert rec["ExitCode"] == "3:0"
    # Still answered by scontrol after the end (MinJobAge), and by sacct.
    assert su.job_state(ok) == "COMPLETED"
    assert su.wait_for_sacct_state(ok, "COMPLETED") == "COMPLETED"


def test_srun_two_tasks():
    proc = su._run(["srun", "-n", "2", "--mem=200", "-t", "1", "sh", "-c", "echo task=$SLURM_PROCID"])
    assert sorted(proc.stdout.split()) == ["task=0", "task=1"]


def test_dependency_afterok_and_kill_on_invalid_dep(tmp_path):
    # A succeeds -> B runs after it.
    a = su.sbatch("-o", str(tmp_path / "a.out"), "--mem=100", "--wrap", "sleep 2; echo A done")
    b = su.sbatch("-o", str(tmp_path / "b.out"), "--mem=100", f"--dependency=afterok:{a}",
                  "--kill-on-invalid-dep=yes", "--wrap", "echo B ran")
    rec_b = su.wait_for_job(b, timeout_s=90)
    rec_a = su.show_job(a)
    assert rec_a["JobState"] == "COMPLETED"
    assert rec_b["JobState"] == "COMPLETED", rec_b
    assert rec_b["StartTime"] >= rec_a["EndTime"]
    assert "B ran" in su.read_log(tmp_path / "b.out")

    # A fails -> B is cancelled, never runs.
    a2 = su.sbatch("-o", str(tmp_path / "a2.out"), "--mem=100", "--wrap", "sleep 1; exit 1")
    b2 = su.sbatch("-o", str(tmp_path / "b2.out"), "--mem=100", f"--dependency=afterok:{a2}",
                   "--kill-on-invalid-dep=yes", "--wrap", "echo B2 ran")
    assert su.wait_for_job(a2, timeout_s=60)["JobState"] == "FAILED"
    rec_b2 = su.wait_for_job(b2, timeout_s=60)
    assert rec_b2["JobState"] == "CANCELLED", rec_b2
    assert rec_b2["Reason"] == "DependencyNeverSatisfied", rec_b2
    assert not (tmp_path / "b2.out").exists()


def test_requeue_released_with_starttime_now(tmp_path):
    log = tmp_path / "rq.out"
    marker = tmp_path / "first_run_started"
    script = textwrap.dedent(f"""\
        #!/bin/bash
        echo "run restart_count=${{SLURM_RESTART_COUNT:-0}}"
        if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
            echo $$ > {marker}
            sleep 300
        fi
        echo "finished restart_count=${{SLURM_RESTART_COUNT:-0}}"
        """)
    job = su.sbatch("-o", str(log), "--open-mode=append", "--requeue", "--mem=100", script=script)
    su.wait_for_state(job, {"RUNNING"}, timeout_s=60)
    for _ in range(100):
        if marker.exists() and marker.read_text().strip():
            break
        time.sleep(0.1)
    first_shell = int(marker.read_text())
    su.requeue(job)
    # Release only once the first run's batch shell is gone: on a loaded machine its end can reach
    # slurmctld after the new run started, and Slurm then records that end (SIGTERM) for the new run.
    for _ in range(600):
        if not Path(f"/proc/{first_shell}").exists():
            break
        time.sleep(0.1)
    # ... and only once slurmd has let go of the first run (its step daemon gone): released while the
    # node still cleans it up, the new run's launch fails (FAILED, exit 1, nothing in the log).
    for _ in range(600):
        pids = su._run(["scontrol", "listpids", str(job)], check=False)
        if pids.returncode != 0 or len(pids.stdout.strip().splitlines()) <= 1:
            break
        time.sleep(0.1)
    rec = su.release_requeued(job, timeout_s=60)
    assert rec["Reason"] in {"BeginTime", "None"}, rec
    final = su.wait_for_job(job, timeout_s=60)
    assert final["JobState"] == "COMPLETED", (final.get("ExitCode"), final.get("Reason"), su.read_log(log))
    assert final["Restarts"] == "1"
    text = su.read_log(log)
    assert "run restart_count=0" in text
    assert "finished restart_count=1" in text
    assert "finished restart_count=0" not in text


def _gloo_rank_sum():
    import torch
    import torch.distributed as dist
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment().export()
    dist.init_process_group("gloo")
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return env.rank, env.world_size, t.item()


def test_submitit_two_task_gloo(tmp_path):
    import submitit

    su.pickle_test_functions_by_value(__name__)
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(slurm_partition="debug", nodes=1, tasks_per_node=2, cpus_per_task=1,
                         slurm_mem="2G", timeout_min=5)
    job = ex.submit(_gloo_rank_sum)
    results = job.results()
    assert sorted(results) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert su.wait_for_job(job.job_id, timeout_s=30)["JobState"] == "COMPLETED"
    # submitit polls sacct; with the slurmdbd accounting it reports the state. slurmdbd
    # records the end asynchronously, a moment after scontrol shows it: poll briefly.
    import time

    deadline = time.monotonic() + 30
    state = job.get_info(mode="force").get("State")
    while state != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(1)
        state = job.get_info(mode="force").get("State")
    assert state == "COMPLETED"
