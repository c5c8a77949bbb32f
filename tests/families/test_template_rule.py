"""The chat template that trains is the model directory's, and it is the one the model ships (issue 49, item 1).

On real replicas (tests/families/replicas.py: the family's tokenizer with its stock
template, as downloaded): ``+experiment=smoke_chat model.name_or_path=DIR`` plans, the
real prepare step renders the shipped conversations, and the trainer's own
``save_hf_assets`` writes ``RUN_DIR/hf_assets`` (what the consolidation copies into
``hf_model/``). The whole chain, consolidation and card included, is the family
matrix's (``test_matrix.py``), which runs the same command with nothing else named.

- a Gemma directory trains on Gemma's template, not smoke_chat's chatml, and ships it;
- a directory without a template trains on the run's (smoke_chat's fallback) and ships it;
- a template whose markers the vocabulary would split is refused at planning, exit 2,
  naming ``data.chat_template``, the marker and the fix;
- a template named on the command line wins over the directory's own, and ships.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List

import forked_cli  # tests/forked_cli.py
import pytest
import yaml

from fsdp_workflow.config.load import CONF_DIR, compose
from fsdp_workflow.data.templates import SHIPPED_TEMPLATES
from tests.data.test_families import TEMPLATES

from .replicas import BY_KEY, Replica

GEMMA = BY_KEY["gemma-3-text"]
QWEN = BY_KEY["qwen2.5"]
BASE = BY_KEY["olmo-2"]  # no template of its own; chatml's markers are in its vocabulary


def _stock(row: Replica) -> str:
    assert row.template_file is not None
    return (TEMPLATES / row.template_file).read_text()


def _train_side(directory: Path, run_dir: Path, *overrides: str) -> Dict[str, Any]:
    """Plan, prepare and write hf_assets as the chain does; returns what rendered the data and what ships."""
    from transformers import AutoConfig, AutoTokenizer

    from fsdp_workflow.config.schema import run_layout
    from fsdp_workflow.data.prepare import prepare
    from fsdp_workflow.data.tokenizer import load_tokenizer
    from fsdp_workflow.plan.checks import check
    from fsdp_workflow.train.assets import save_hf_assets

    cfg = compose(["+experiment=smoke_chat", f"model.name_or_path={directory}", f"run_dir={run_dir}",
                   "train.seq_len=128", "data.num_workers=1", *overrides])
    report = check(cfg)
    assert report.ok, report.errors
    prepared = prepare(cfg, num_workers=1, progress=False)
    tokenizer = load_tokenizer(cfg.model)
    assets = save_hf_assets(run_layout(cfg), AutoConfig.from_pretrained(str(directory)), None, tokenizer)
    return {"trained": prepared.meta["chat_template"], "name": prepared.meta.get("chat_template_name"),
            "key": prepared.meta.get("chat_template_key"), "notes": report.notes,
            "shipped": AutoTokenizer.from_pretrained(str(assets)).chat_template,
            "tokenizer_after": tokenizer.chat_template, "files": sorted(p.name for p in assets.iterdir())}


def test_a_gemma_directory_trains_on_its_own_template_and_ships_it(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    """smoke_chat names chatml for its byte-level model; a Gemma directory's own template wins over it."""
    got = _train_side(replica(GEMMA), tmp_path / "run")
    assert got["trained"] == _stock(GEMMA), "the data was not rendered by Gemma's own template"
    assert "<start_of_turn>" in got["trained"] and "<|im_start|>" not in got["trained"]
    assert got["shipped"] == got["trained"]
    assert got["key"] is None and str(replica(GEMMA)) in got["name"]
    assert any("tokenizer's own" in n and "fallback_chat_template=chatml" in n for n in got["notes"]), got["notes"]


def test_a_directory_without_a_template_ships_the_one_the_run_names(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(replica(BASE))).chat_template is None  # the base model has none
    got = _train_side(replica(BASE), tmp_path / "run")
    assert got["trained"] == SHIPPED_TEMPLATES["chatml"]
    assert got["shipped"] == SHIPPED_TEMPLATES["chatml"], "hf_assets ships no template, or another one"
    assert "chat_template.jinja" in got["files"]
    assert (got["key"], got["name"]) == ("data.fallback_chat_template", "chatml")
    assert got["tokenizer_after"] is None  # the tokenizer training holds is left as it was


def test_a_template_named_on_the_command_line_wins_and_ships(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    """Qwen2.5's vocabulary has chatml's markers: data.chat_template=chatml trains instead of Qwen's own."""
    assert _stock(QWEN) != SHIPPED_TEMPLATES["chatml"]
    got = _train_side(replica(QWEN), tmp_path / "run", "data.chat_template=chatml")
    assert got["trained"] == SHIPPED_TEMPLATES["chatml"] and got["shipped"] == SHIPPED_TEMPLATES["chatml"]
    assert (got["key"], got["name"]) == ("data.chat_template", "chatml")
    assert any("instead of the tokenizer's own" in n for n in got["notes"]), got["notes"]


def _dry_run(args: List[str], cwd: Path) -> Any:
    return forked_cli.run(["+experiment=smoke_chat", "dry_run=true", *args], cwd=cwd)


def test_markers_the_vocabulary_splits_are_refused_at_planning(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    """chatml on Gemma's vocabulary: <|im_start|> would be bytes. Exit 2, the key, the marker and the fix."""
    run_dir = tmp_path / "refused"
    proc = _dry_run([f"model.name_or_path={replica(GEMMA)}", "data.chat_template=chatml", f"run_dir={run_dir}"],
                    tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.chat_template" in proc.stderr and "<|im_start|>" in proc.stderr and "<|im_end|>" in proc.stderr
    assert "data.chat_template=null" in proc.stderr  # the fix: the directory's own template
    assert not run_dir.exists()  # nothing was written


def gemma_without_template(replica: Callable[[Replica], Path], tmp_path: Path) -> Path:
    """A copy of the Gemma replica whose tokenizer has no chat template: Gemma's vocabulary, no template."""
    base = tmp_path / "gemma-base"
    shutil.copytree(replica(GEMMA), base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    return base


def test_a_base_model_whose_vocabulary_splits_the_fallback_is_refused(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    """Gemma's vocabulary without its template: smoke_chat's fallback chatml cannot train either."""
    base = gemma_without_template(replica, tmp_path)
    proc = _dry_run([f"model.name_or_path={base}", f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.chat_template" in proc.stderr and "fallback_chat_template=chatml" in proc.stderr
    assert "<|im_start|>" in proc.stderr
    ok = _dry_run([f"model.name_or_path={base}", f"run_dir={tmp_path / 'named'}",
                   "data.chat_template='{% for m in messages %}<{{ m.role }}>{{ m.content }}</turn>{{ eos_token }}"
                   "{% endfor %}'"], tmp_path)
    # A plain-text template of the user's own plans; its tags, which no token spells, are only a warning.
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "warning: data.chat_template" in ok.stderr and "</turn>" in ok.stderr and "<user>" in ok.stderr


def test_the_fix_for_a_directory_without_a_template_is_one_its_vocabulary_can_spell(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    """data=chat_jsonl names no template: the fix offers chatml only where its markers are tokens, and it plans."""
    from fsdp_workflow.plan.checks import check

    base = gemma_without_template(replica, tmp_path)
    data = ["data=chat_jsonl", f"data.path={CONF_DIR.parent / 'assets' / 'smoke' / 'chat.jsonl'}", "dry_run=true"]
    fixes = {}
    for name, directory in (("gemma", base), ("base", replica(BASE))):
        report = check(compose([*data, f"model.name_or_path={directory}", f"run_dir={tmp_path / name}"]))
        assert [i.key for i in report.errors] == ["data.chat_template"], report.errors
        fixes[name] = report.errors[0].fix
    assert "chatml" in fixes["gemma"] and "a Jinja template of your own" in fixes["gemma"]
    assert not fixes["gemma"].startswith("data.chat_template=chatml")
    assert fixes["base"].startswith("data.chat_template=chatml ")
    followed = check(compose([*data, f"model.name_or_path={replica(BASE)}", "data.chat_template=chatml",
                              f"run_dir={tmp_path / 'followed'}"]))
    assert followed.ok, followed.errors


def test_a_slow_tokenizer_or_the_byte_level_one_is_not_judged(tmp_path: Path) -> None:
    """Without tokenizer.json (a binary vocabulary) or with the tiny models' bytes, nothing is refused."""
    from fsdp_workflow.data.template_markers import vocabulary_tokens
    from fsdp_workflow.data.tokenizer import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(tmp_path / "bytes")
    assert vocabulary_tokens(str(tmp_path / "bytes")) is None
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"0": {"content": "<unk>"}}}))
    assert vocabulary_tokens(str(tmp_path / "slow")) is None


def test_a_template_your_own_experiment_names_counts_as_named(
        replica: Callable[[Replica], Path], tmp_path: Path) -> None:
    """An experiment of the user's (hydra.searchpath), extending smoke_chat, names chatml: it is not overridden
    by the directory's own template (so on Gemma's vocabulary it is refused); one naming nothing gets Gemma's."""
    conf = tmp_path / "my_conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - smoke_chat\n  - _self_\n"
                                    "data:\n  chat_template: chatml\n")
    (conf / "plain.yaml").write_text("# @package _global_\ndefaults:\n  - smoke_chat\n  - _self_\nname: plain\n")
    search = f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"
    named = forked_cli.run([search, "+experiment=mine", f"model.name_or_path={replica(GEMMA)}", "dry_run=true",
                            f"run_dir={tmp_path / 'mine'}"], cwd=tmp_path)
    assert named.returncode == 2 and "data.chat_template = 'chatml'" in named.stderr, named.stdout + named.stderr
    plain = forked_cli.run([search, "+experiment=plain", f"model.name_or_path={replica(GEMMA)}", "dry_run=true",
                            f"run_dir={tmp_path / 'plain'}"], cwd=tmp_path)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "the chat template is the tokenizer's own" in plain.stderr
    recorded = yaml.safe_load((tmp_path / "plain" / "config.yaml").read_text())["data"]
    assert (recorded["chat_template"], recorded["fallback_chat_template"]) == (None, "chatml")


def test_no_shipped_config_names_a_chat_template() -> None:
    """A shipped experiment's template is only a fallback: data.chat_template is the user's to set."""
    named = {}
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        text = yaml.safe_load(path.read_text()) or {}
        data = text.get("data", {}) if "experiment" in path.parts else text if "data" in path.parts else {}
        if isinstance(data, dict) and data.get("chat_template") is not None:
            named[str(path.relative_to(CONF_DIR))] = data["chat_template"]
    assert not named, f"shipped configs set data.chat_template (use data.fallback_chat_template): {named}"
    assert compose(["+experiment=smoke_chat"]).data.fallback_chat_template == "chatml"


@pytest.mark.parametrize("name", sorted(SHIPPED_TEMPLATES))
def test_the_markers_of_each_shipped_template_are_found(name: str) -> None:
    from fsdp_workflow.data.template_markers import template_markers

    want = {"chatml": ["<|im_start|>", "<|im_end|>"],
            "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}[name]
    assert template_markers(SHIPPED_TEMPLATES[name]) == want
