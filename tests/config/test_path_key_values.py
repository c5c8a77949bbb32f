"""Which values of the path keys are paths (made absolute) and which are names (left as given); issue 36, item 7.

The CLI's behaviour (config.yaml, prepare from elsewhere, refusals) is in tests/cli/test_path_keys.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_workflow.config.load import compose
from fsdp_workflow.config.path_keys import make_paths_absolute


def test_paths_are_made_absolute_and_names_are_left_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").mkdir()
    (tmp_path / "ckpt" / "step-4").mkdir(parents=True)
    (tmp_path / "img.sif").write_text("")
    (tmp_path / "shared").mkdir()
    cfg = compose(["+experiment=smoke", "run_dir=run", "model.tokenizer=tok", "checkpoint.resume=ckpt/step-4",
                   "container.image=img.sif", "container.binds=[shared:/mnt/shared:ro,missing:/x]",
                   "cluster.env_script=env.sh", "data.eval_path=~/held.jsonl"])
    make_paths_absolute(cfg)
    assert cfg.run_dir == str(tmp_path / "run")
    assert cfg.model.tokenizer == str(tmp_path / "tok")  # exists here: a path
    assert cfg.checkpoint.resume == str(tmp_path / "ckpt" / "step-4")
    assert cfg.container.image == str(tmp_path / "img.sif")
    # the source of a bind that exists is made absolute; one that does not is left for the bind check to name
    assert cfg.container.binds == [f"{tmp_path / 'shared'}:/mnt/shared:ro", "missing:/x"]
    assert cfg.cluster.env_script == str(tmp_path / "env.sh")  # only ever a path
    assert cfg.data.eval_path == os.path.expanduser("~/held.jsonl")
    names = compose(["+experiment=smoke", "run_dir=run", "model.tokenizer=meta-llama/Llama-3.2-1B",
                     "checkpoint.resume=auto", "container.image=docker://nvcr.io/nvidia/pytorch:24.01-py3"])
    make_paths_absolute(names)
    assert (names.model.tokenizer, names.checkpoint.resume, names.container.image) == (
        "meta-llama/Llama-3.2-1B", "auto", "docker://nvcr.io/nvidia/pytorch:24.01-py3")  # a hub id, a word, a URI
