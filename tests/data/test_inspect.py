"""The inspect command: text for a person, JSON for tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_workflow.config.load import to_yaml
from fsdp_workflow.config.schema import DataSource, run_layout
from fsdp_workflow.data.inspect import main
from fsdp_workflow.data.prepare import prepare

from .conftest import chat_run_dir, make_cfg

CHAT = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(4)]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    cfg = chat_run_dir(tmp_path, CHAT)
    prepare(cfg, num_workers=1, progress=False)
    return run_layout(cfg).root


def test_json(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(run), "-n", "2", "--json"]) == 0
    samples = json.loads(capsys.readouterr().out)
    assert len(samples) == 2
    s = samples[0]
    assert len(s["input_ids"]) == len(s["labels"]) == len(s["position_ids"]) == len(s["trained"]) == 256
    for a, b in s["documents"]:
        assert s["position_ids"][a] == 0
        text = "".join(s["pieces"][a:b])
        trained = "".join(p for p, t in zip(s["pieces"][a:b], s["trained"][a:b]) if t)
        assert text.startswith("<|im_start|>user\nq") and trained.startswith("a") and trained.endswith("<|im_end|>\n")
    assert not any(s["trained"][s["num_tokens"]:])


def test_text(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(run), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "=== sample 0 (train)" in out and "|| document 1" in out and "|| padding" in out
    assert "[a(97, 97)]" in out and "q(-100, 113)" in out


def test_unprepared_run_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(tmp_path / "run", source=DataSource.text, path="x.txt")
    run_layout(cfg).root.mkdir(parents=True)
    run_layout(cfg).config.write_text(to_yaml(cfg))
    assert main([str(tmp_path / "run")]) == 2
    assert "python -m fsdp_workflow.data.prepare" in capsys.readouterr().err


def test_inspect_shows_each_documents_file_and_line(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every cached document traces back to its source: inspect prints file:line, --json lists them."""
    assert main([str(run), "-n", "4"]) == 0
    out = capsys.readouterr().out
    shown = sorted(int(m) for m in __import__("re").findall(r"chat\.jsonl:(\d+), tokens", out))
    assert shown == [1, 2, 3, 4]  # every document of every sample, each from its own line
    assert main([str(run), "-n", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)[0]
    for src, (a, b) in zip(s["sources"], s["documents"]):
        line = int(src.rsplit(":", 1)[1])
        assert src.rsplit(":", 1)[0].endswith("chat.jsonl")
        text = "".join(s["pieces"][a:b])
        assert f"q{line - 1}" in text and f"a{line - 1}" in text  # line n holds CHAT[n - 1]


def test_output_cut_short_by_a_pipe_is_quiet(tmp_path: Path) -> None:
    """`data.inspect RUN_DIR -n 200 | head -1`: the reader leaves early; no BrokenPipe traceback, exit 0."""
    import subprocess
    import sys

    chat = [{"messages": [{"role": "user", "content": f"question {i} " * 8},
                          {"role": "assistant", "content": f"answer {i} " * 8}]} for i in range(400)]
    cfg = chat_run_dir(tmp_path, chat)
    layout = run_layout(cfg)
    prepare(cfg, num_workers=1, progress=False)
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_workflow.data.inspect", str(layout.root), "-n", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline()  # what `head -1` reads, then it closes the pipe
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
