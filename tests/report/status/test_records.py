"""``status`` reports every broken record (file, line, what is wrong) instead of skipping it.

Each case writes a real run directory (tests/status/fixtures.py) and breaks one real file
the way a crash, a full disk or a hand edit leaves it; the report must name it.
"""

from __future__ import annotations

import json

import pytest

from fsdp_workflow.report.status.__main__ import main

from .fixtures import write_heartbeat, write_run


def _status(run_root, capsys) -> tuple:
    """(text report, --json report) of ``run_root``; both must exit 0."""
    assert main([str(run_root)]) == 0
    text = capsys.readouterr().out
    assert main([str(run_root), "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def _broken(text: str) -> list:
    return [line[len("broken record: "):] for line in text.splitlines() if line.startswith("broken record: ")]


def test_a_bad_metrics_line_is_named_by_line_number_and_a_line_being_written_is_not(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=60)
    lines = run.metrics.read_text().splitlines(keepends=True)
    lines[50] = "\x00\x00garbage from a bad disk\n"  # line 51
    lines.insert(55, "[1, 2, 3]\n")  # line 56: JSON, but not a step record
    run.metrics.write_text("".join(lines) + '{"step": 61, "lo')  # the trainer is writing step 61 right now
    text, js = _status(run.root, capsys)
    assert _broken(text) == [f"{run.metrics}:51: not JSON", f"{run.metrics}:56: not a step record (no integer \"step\")"]
    assert js["problems"] == _broken(text)
    assert js["progress"]["step"] == 60  # the good lines still count


@pytest.mark.parametrize("content, why", [
    ("{\"exit_code\": 75, \"reas", "not JSON"),
    ("", "empty"),
    ("[75]", "not a JSON object (a list)"),
    ("{\"exit_code\": \"75\"}", "no integer exit_code (found '75')"),
])
def test_a_broken_train_exit_json_is_reported(tmp_path, capsys, content, why):
    run = write_run(tmp_path / "run", steps=5, alive=False)
    run.train_exit.write_text(content)
    text, js = _status(run.root, capsys)
    assert [p for p in _broken(text) if p.startswith(str(run.train_exit))][0].startswith(f"{run.train_exit}: {why}")
    assert any(p.startswith(f"{run.train_exit}: {why}") for p in js["problems"])


def test_broken_provenance_evals_heartbeat_and_an_unreadable_file_are_each_reported(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=5)
    run.provenance.write_text('{"git_revision": "abc", "code_snap')
    run.evals_file.write_text(json.dumps({"step": 2, "loss": 1.5}) + "\n{torn\n" + json.dumps({"step": 4, "loss": 1.4}) + "\n")
    write_heartbeat(run, 1, 1)
    run.heartbeat(1).write_text('{"rank": 1, "host": "h", "pid": 1')  # torn by a full disk
    run.heartbeat(2).write_text(json.dumps({"rank": 2, "host": "h"}))  # no pid, no time
    run.train_exit.mkdir()  # a directory where a file belongs: unreadable
    text, js = _status(run.root, capsys)
    problems = _broken(text)
    assert problems[0].startswith(f"{run.provenance}: not JSON (")
    assert f"{run.evals_file}:2: not JSON" in problems
    assert any(p.startswith(f"{run.heartbeat(1)}: not JSON") for p in problems)
    assert any(p.startswith(f"{run.heartbeat(2)}: not a heartbeat record") for p in problems)
    assert any(p.startswith(f"{run.train_exit}: unreadable: Is a directory") for p in problems)
    assert len(problems) == 5, problems
    assert js["last_eval"] == {"step": 4, "loss": 1.4}  # the good lines still count


def test_a_config_that_is_not_yaml_is_reported(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=5)
    run.config.write_text("train: {max_steps: [\n")
    text, _ = _status(run.root, capsys)
    assert any(p.startswith(f"{run.config}: not YAML (") for p in _broken(text))


def test_the_fixtures_torn_line_from_a_crash_is_reported_and_a_clean_run_has_no_problem(tmp_path, capsys):
    run = write_run(tmp_path / "run")  # 500 steps: a crash tore the line after step 250
    text, _ = _status(run.root, capsys)
    torn = run.metrics.read_text().splitlines().index('{"step": 251, "lo') + 1
    assert _broken(text) == [f"{run.metrics}:{torn}: not JSON"]
    clean = write_run(tmp_path / "clean", steps=30)
    text, js = _status(clean.root, capsys)
    assert _broken(text) == [] and js["problems"] == []
