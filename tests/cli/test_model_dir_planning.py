"""``model.name_or_path=DIR`` alone plans that model; a directory that cannot train is refused at planning.

Through the real command (forked, dry runs): the directory's config.json wins over
the group's values with one note; the run records the absolute path; a hub id in
the local cache resolves; each broken directory exits 2 naming the key, why and
the fix, and writes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict

import forked_cli  # tests/forked_cli.py
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tests" / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja"
SMALL = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)


def _save(out: Path, kind: str, **extra: Any) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_workflow.data.tokenizer import byte_level_tokenizer

    config = AutoConfig.for_model(kind, **{**SMALL, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok = byte_level_tokenizer()
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {
        "qwen3": _save(root / "Qwen3-tiny", "qwen3", tie_word_embeddings=True, head_dim=16),
        "gemma2": _save(root / "gemma-2-tiny", "gemma2", head_dim=16),
        "moe": _save(root / "Qwen3-MoE-tiny", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, head_dim=16),
    }
    broken = {
        "unknown_type": lambda d: _edit_config(d, model_type="qwen9"),
        "remote_code": lambda d: _edit_config(d, model_type="qwen9",
                                              auto_map={"AutoModelForCausalLM": "modeling_q.Q9ForCausalLM"}),
        "no_weights": lambda d: (d / "model.safetensors").unlink(),
        "no_tokenizer": lambda d: (d / "tokenizer.json").unlink(),
        "no_config": lambda d: (d / "config.json").unlink(),
    }
    for name, damage in broken.items():
        out[name] = root / name
        shutil.copytree(out["qwen3"], out[name])
        damage(out[name])
    return out


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def cli(*args: str, cwd: Path, env: Dict[str, str] | None = None):
    return forked_cli.run(["+experiment=smoke_chat", *args], cwd=cwd,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {})), timeout=120)


def _planned(tmp_path: Path, *args: str, env: Dict[str, str] | None = None):
    run = tmp_path / "run"
    res = cli(*args, "dry_run=true", f"run_dir={run}", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load((run / "config.yaml").read_text())["model"], res.stdout + res.stderr


def test_a_directory_alone_is_that_model(dirs, tmp_path: Path) -> None:
    # A relative path, from the directory above the model: recorded absolute.
    model, out = _planned(dirs["qwen3"].parent, f"model.name_or_path={dirs['qwen3'].name}")
    assert model["init"] == "pretrained"
    assert model["name_or_path"] == str(dirs["qwen3"])
    assert (model["model_type"], model["architecture"], model["decoder_layer_cls"]) == \
        ("qwen3", "Qwen3ForCausalLM", "Qwen3DecoderLayer")
    assert (model["tie_word_embeddings"], model["vocab_size"], model["hidden_size"]) == (True, 272, 64)
    assert model["name"] == "Qwen3-tiny"  # the shipped group's label gave way to the directory's
    note = [line for line in out.splitlines() if "fsdp_workflow: note: model:" in line]
    assert len(note) == 1 and "model.decoder_layer_cls 'LlamaDecoderLayer' -> 'Qwen3DecoderLayer'" in note[0]
    summary = next(line for line in out.splitlines() if line.strip().startswith("model "))
    assert "qwen3 (Qwen3ForCausalLM)" in summary and "tied embeddings" in summary
    assert "wraps Qwen3DecoderLayer" in summary and f"weights of {dirs['qwen3']}" in summary


def test_moe_shows_total_and_active_parameters(dirs, tmp_path: Path) -> None:
    from fsdp_workflow.config.model_size import count_config

    _, out = _planned(tmp_path, f"model.name_or_path={dirs['moe']}")
    count = count_config(json.loads((dirs["moe"] / "config.json").read_text()))
    assert count.active < count.total
    summary = next(line for line in out.splitlines() if line.strip().startswith("model "))
    assert f"{count.total / 1e3:.3g} K parameters ({count.active / 1e3:.3g} K active: 2 of 4 experts" in summary


def test_gemma2_gets_an_attention_it_supports(dirs, tmp_path: Path) -> None:
    model, out = _planned(tmp_path, f"model.name_or_path={dirs['gemma2']}")
    assert model["attn_implementation"] == "eager"
    assert "attn_implementation 'sdpa' -> 'eager' (Gemma2ForCausalLM does not support sdpa)" in out


def test_random_weights_follow_the_model_type(tmp_path: Path) -> None:
    model, out = _planned(tmp_path, "model.model_type=qwen3")
    assert model["init"] == "random"
    assert (model["architecture"], model["decoder_layer_cls"]) == ("Qwen3ForCausalLM", "Qwen3DecoderLayer")


def test_a_hub_id_in_the_local_cache_is_its_snapshot(dirs, tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-tiny"
    snapshot = repo / "snapshots" / "0123abc"
    shutil.copytree(dirs["qwen3"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    model, out = _planned(tmp_path, "model.name_or_path=Qwen/Qwen3-tiny", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert model["name_or_path"] == str(snapshot)
    assert "is the local hub cache's" in out


REFUSED = [
    ("unknown_type", [], "model.name_or_path", "model_type='qwen9', which transformers"),
    ("remote_code", [], "model.name_or_path", "model.trust_remote_code=true"),
    ("no_weights", [], "model.name_or_path", "the directory has no weights"),
    ("no_tokenizer", [], "model.tokenizer", "the model directory has no tokenizer"),
    ("no_config", [], "model.name_or_path", "this model directory has no config.json"),
    ("qwen3", ["train.seq_len=1024"], "train.seq_len", "max_position_embeddings (512); without rope scaling"),
]


@pytest.mark.parametrize("name,extra,key,why", REFUSED, ids=[r[0] + " " + " ".join(r[1])
                                                            for r in REFUSED])
def test_a_directory_that_cannot_train_is_refused_at_planning(dirs, tmp_path: Path, name, extra, key, why) -> None:
    run = tmp_path / "run"
    res = cli(f"model.name_or_path={dirs[name]}", *extra, f"run_dir={run}", cwd=tmp_path)  # a real run, refused
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{key} = " in res.stderr and why in res.stderr, res.stderr
    assert "fix: " in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not run.exists() and list(tmp_path.iterdir()) == [], "something was written for a refused config"


def test_explicit_rope_scaling_allows_a_longer_sequence(dirs, tmp_path: Path) -> None:
    model, _ = _planned(tmp_path, f"model.name_or_path={dirs['qwen3']}", "train.seq_len=1024",
                        "+model.extra_config.rope_scaling={rope_type: yarn, factor: 2.0, "
                        "original_max_position_embeddings: 512}")
    assert model["extra_config"]["rope_scaling"]["rope_type"] == "yarn"


def test_the_consolidated_model_keeps_the_directorys_dtype(dirs, tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16-model"
    shutil.copytree(dirs["qwen3"], bf16)
    _edit_config(bf16, dtype="bfloat16")
    (tmp_path / "a").mkdir()
    _planned(tmp_path / "a", f"model.name_or_path={bf16}")  # consolidate.dtype=auto, smoke_chat's value
    assert "--dtype bf16" in (tmp_path / "a" / "run" / "consolidate.sbatch").read_text()
    (tmp_path / "b").mkdir()
    _planned(tmp_path / "b", f"model.name_or_path={bf16}", "consolidate.dtype=keep")
    assert "--dtype" not in (tmp_path / "b" / "run" / "consolidate.sbatch").read_text()
    (tmp_path / "c").mkdir()
    _planned(tmp_path / "c")  # the random tiny model: the checkpoint's own fp32
    assert "--dtype" not in (tmp_path / "c" / "run" / "consolidate.sbatch").read_text()
