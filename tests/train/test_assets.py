"""RUN_DIR/hf_assets: the config, tokenizer and, for a pretrained base, its licence terms."""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_workflow.config.load import compose
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.data.tokenizer import load_tokenizer
from fsdp_workflow.train.assets import save_hf_assets
from fsdp_workflow.train.model import build_model


def _assets(tmp_path: Path, base_dir: str | None) -> set[str]:
    cfg = compose(["+experiment=smoke", f"run_dir={tmp_path / 'run'}"])
    model = build_model(cfg.model, seed=0, meta=True)
    run = RunDir.of(tmp_path / "run")
    dest = save_hf_assets(run, model.config, None, load_tokenizer(cfg.model), base_dir=base_dir)
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    return {p.name for p in dest.iterdir()}


def test_a_pretrained_bases_licence_use_policy_and_card_travel_with_the_assets(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    for name in ("LICENSE", "USE_POLICY.md", "NOTICE.txt", "README.md", "notes.txt", "model.safetensors"):
        (base / name).write_text(name)
    names = _assets(tmp_path, str(base))
    assert {"LICENSE", "USE_POLICY.md", "NOTICE.txt", "README.md"} <= names
    assert not {"notes.txt", "model.safetensors"} & names


def test_a_random_init_has_no_base_to_copy_from(tmp_path: Path) -> None:
    names = _assets(tmp_path, None)
    assert "config.json" in names and not {"LICENSE", "README.md"} & names
