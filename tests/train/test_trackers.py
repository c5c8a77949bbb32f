"""``train.report_to=[tensorboard,mlflow]``: what a real 2-rank run wrote, read back with each tool's own reader.

One gloo run (6 steps, in-loop eval at step 3 and 6) serves every assertion:
TensorBoard's ``EventAccumulator`` and MLflow's ``MlflowClient`` on the
``file://`` store under ``RUN_DIR/trackers/`` must hold every numeric field of
every ``metrics.jsonl`` line at its step, the flattened config as
hyperparameters, and only rank 0's writing. The evaluation job's hook
(``fsdp_workflow.evaluate.eval_record.track_result``) then logs an ``evals.jsonl``
line into the same TensorBoard folder and the same MLflow run. The run's log
(stderr piped to a file, as in a Slurm job) doubles as the non-TTY progress check.
No network: both trackers write local files. tensorboard and mlflow-skinny come
with the dev extra.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_workflow.config.load import load_run_config
from fsdp_workflow.config.schema import WorkflowConfig
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.train.trackers import CHECKPOINT_EVAL_PREFIX, NOT_LOGGED, flat_config

from tests.train.runner import launch_env, launched, log_text, make_run_dir

pytestmark = pytest.mark.slow

STEPS = 6
EVAL_RECORD = {"step": STEPS, "status": "ok", "loss": 2.5, "perplexity": 12.18, "num_tokens": 4032,
               "job_id": None, "seconds": 1.5}


@dataclass
class TrackedRun:
    run_dir: Path
    event_files_after_training: list[Path]
    rank0_pid: int


def _event_files(run: RunDir) -> list[Path]:
    return sorted(run.tracker_dir("tensorboard").rglob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> TrackedRun:
    run_dir = make_run_dir(tmp_path_factory.mktemp("trackers") / "run", [
        f"train.max_steps={STEPS}", "train.eval_every_steps=3", "train.eval_batches=1",
        "checkpoint.every_steps=0", "checkpoint.save_final=false", "train.report_to=[tensorboard,mlflow]"])
    launched(run_dir)
    run = RunDir.of(run_dir)
    pid = re.search(r"rank 0 of 2 .* pid (\d+)", log_text(run_dir))
    assert pid, log_text(run_dir)
    files = _event_files(run)
    # the evaluation job's hook, in a process of its own, as eval.sbatch runs it
    code = ("import json, sys; from pathlib import Path; from fsdp_workflow.core.logs import setup_logging; "
            "from fsdp_workflow.evaluate.eval_record import track_result; from fsdp_workflow.evaluate.run import open_run; "
            "setup_logging(); track_result(open_run(Path(sys.argv[1])), json.loads(sys.argv[2]))")
    ev = subprocess.run([sys.executable, "-c", code, str(run_dir), json.dumps(EVAL_RECORD)],
                        env=launch_env(run_dir), capture_output=True, text=True, timeout=180)
    assert ev.returncode == 0 and "logged to tensorboard, mlflow" in ev.stderr, ev.stderr
    return TrackedRun(run_dir, files, int(pid.group(1)))


def _config_leaves(cls: type = WorkflowConfig, prefix: str = "") -> set[str]:
    """Every leaf key of the schema, from the dataclasses themselves (not from the code under test)."""
    hints = typing.get_type_hints(cls)
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        is_section = dataclasses.is_dataclass(hints[f.name])
        out |= _config_leaves(hints[f.name], f"{prefix}{f.name}.") if is_section else {prefix + f.name}
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _mlflow(run_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=RunDir.of(run_dir).tracker_dir("mlflow").as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "smoke"]
    return client, client.search_runs([experiment.experiment_id])


def _tensorboard(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_has_every_metrics_field_at_its_step(tracked: TrackedRun) -> None:
    acc = _tensorboard(RunDir.of(tracked.run_dir).tracker_dir("tensorboard"))
    records = _metrics(tracked.run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    fields = {k for r in records for k in r} - set(NOT_LOGGED)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "eval_loss"} <= fields
    assert set(acc.Tags()["scalars"]) >= fields
    for name in fields:
        logged = {e.step: e.value for e in acc.Scalars(name)}
        expected = {r["step"]: r[name] for r in records if name in r}
        assert logged.keys() == expected.keys(), name
        for step, value in expected.items():  # TensorBoard keeps float32
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-12), (name, step)


def test_tensorboard_hyperparameters_are_the_flattened_config(tracked: TrackedRun) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    expected = flat_config(load_run_config(tracked.run_dir))
    [hparams_dir] = {p.parent for p in tracked.event_files_after_training} - {
        RunDir.of(tracked.run_dir).tracker_dir("tensorboard")}
    content = _tensorboard(hparams_dir).PluginTagToContent("hparams")
    start = [plugin_data_pb2.HParamsPluginData.FromString(c).session_start_info for c in content.values()
             if plugin_data_pb2.HParamsPluginData.FromString(c).HasField("session_start_info")]
    hparams = start[0].hparams
    assert set(hparams.keys()) == set(expected) == _config_leaves()
    assert hparams["train.max_steps"].number_value == STEPS
    assert hparams["name"].string_value == "smoke"
    assert hparams["train.report_to"].string_value == '["tensorboard", "mlflow"]'


def test_mlflow_has_every_metrics_field_and_the_config(tracked: TrackedRun, monkeypatch) -> None:
    client, runs = _mlflow(tracked.run_dir, monkeypatch)
    assert len(runs) == 1  # rank 0 only; the eval job resumed the same run
    run_id = runs[0].info.run_id
    assert json.loads(RunDir.of(tracked.run_dir).tracker_ids.read_text())["mlflow"] == run_id
    records = _metrics(tracked.run_dir)
    fields = {k for r in records for k in r} - set(NOT_LOGGED)
    for name in fields:
        logged = {m.step: m.value for m in client.get_metric_history(run_id, name)}
        assert logged == {r["step"]: r[name] for r in records if name in r}, name
    params = runs[0].data.params
    assert set(params) == _config_leaves()
    assert params == {k: str(v) for k, v in flat_config(load_run_config(tracked.run_dir)).items()}
    assert (params["train.max_steps"], params["optimizer.lr"], params["name"]) == (str(STEPS), "0.003", "smoke")


def test_checkpoint_eval_reaches_the_same_runs(tracked: TrackedRun, monkeypatch) -> None:
    client, [run] = _mlflow(tracked.run_dir, monkeypatch)
    for name in ("loss", "perplexity", "num_tokens"):
        [metric] = client.get_metric_history(run.info.run_id, CHECKPOINT_EVAL_PREFIX + name)
        assert (metric.step, metric.value) == (STEPS, EVAL_RECORD[name])
    assert not client.get_metric_history(run.info.run_id, CHECKPOINT_EVAL_PREFIX + "seconds")
    acc = _tensorboard(RunDir.of(tracked.run_dir).tracker_dir("tensorboard"))
    [event] = acc.Scalars(CHECKPOINT_EVAL_PREFIX + "perplexity")
    assert (event.step, event.value) == (STEPS, pytest.approx(EVAL_RECORD["perplexity"], rel=1e-6))


def test_only_rank0_wrote_tensorboard(tracked: TrackedRun) -> None:
    # event file names end in <host>.<pid>.<n>: every one is rank 0's
    files = tracked.event_files_after_training
    assert len(files) == 2  # the scalars, and Accelerate's add_hparams folder
    assert {int(f.name.split(".")[-2]) for f in files} == {tracked.rank0_pid}


def test_job_log_is_rank_filtered_progress_lines_without_carriage_returns(tracked: TrackedRun) -> None:
    log = log_text(tracked.run_dir)  # stderr to a file, as Slurm's --output: no terminal
    assert "\r" not in log
    assert re.search(rf"INFO \[rank 0/\S+\] \S+: step 5/{STEPS} \(83%\): loss \d", log), log
    assert re.search(rf"step {STEPS}/{STEPS} \(100%\): .* eval_loss \d", log), log
    assert "INFO [rank 1/" not in log  # rank 1 logs warnings only
    assert "[rank 0/" in log and "experiment trackers: tensorboard, mlflow" in log
