"""The model card (:mod:`fsdp_workflow.report.card`): written by the report stage from the run record.

A run directory is built in tmp the way the planner and the trainer leave it (a real
config.yaml composed through the schema, metrics.jsonl, evals.jsonl, hf_assets/,
checkpoints/step-N/ saved by DCP from a real tiny Llama), consolidated with
:func:`consolidate`, then carded by ``python -m fsdp_workflow.report.card MODEL --run-dir RUN``
as the consolidation job runs it: the run directory is passed, never guessed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from transformers import LlamaForCausalLM

from fsdp_workflow.config.record import open_run
from fsdp_workflow.consolidate import consolidate
from fsdp_workflow.consolidate.hf_assets import licence_files
from fsdp_workflow.core.modeldir import CARD_FILE, CURVE_FILE, VERIFICATION_FILE
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.report import card as card_mod
from fsdp_workflow.report.card import main, read_run_facts, write_card
from fsdp_workflow.report.curves import read_series
from fsdp_workflow.report.plot import STEP_LABEL, curve_figure
from fsdp_workflow.report.status import plot_option as status_plot
from tests.consolidate.layouts import save
from tests.consolidate.test_hf_assets import APACHE, LLAMA31, QWEN, tiny_model
from tests.report.status.fixtures import config_yaml

RUN_OVERRIDES = ("name=tiny-sft", "model.init=pretrained", "data.source=jsonl", "data.path=/data/sft.jsonl",
                 "data.format=conversation", "data.train_on=assistant", "strategy=fsdp2", "optimizer.lr=1e-5",
                 "optimizer.scheduler=cosine", "optimizer.warmup_steps=2", "cluster.nodes=2",
                 "cluster.processes_per_node=8", "train.max_steps=5", "train.seq_len=64", "train.global_batch_size=8",
                 "train.mixed_precision=bf16")


def metric(step: int, loss: float, tokens: int, **extra: object) -> str:
    return json.dumps({"time": 1.0, "step": step, "loss": loss, "lr": 1e-5, "trained_tokens": tokens, **extra})


def make_run(root: Path, model: LlamaForCausalLM, *, base: str = "/nonexistent/base", licence: str | None = LLAMA31,
             metrics: list[str] | None = None, step: int = 4, overrides: tuple[str, ...] = ()) -> RunDir:
    """A run directory as the trainer leaves it after step ``step`` (plus a later step, not consolidated)."""
    run = RunDir(root)
    root.mkdir(parents=True)
    run.config.write_text(config_yaml(root, *RUN_OVERRIDES, f"model.name_or_path={base}", *overrides))
    run.provenance.write_text(json.dumps({"git_revision": "abc123", "command": ["x"]}))
    lines = metrics if metrics is not None else [
        metric(1, 3.0, 100), metric(2, 2.5, 110), metric(3, 9.9, 999),
        "{\"step\": 4, \"lo",  # torn by a crash, then the resume redid step 3
        metric(3, 2.25, 120, eval_loss=2.4), metric(4, 2.125, 130), metric(5, 1.5, 140),
    ]
    run.metrics.write_text("\n".join(lines) + "\n")
    run.evals_file.write_text(json.dumps({"step": 4, "status": "ok", "perplexity": 8.5, "loss": 2.14,
                                          "num_tokens": 512}) + "\n")
    model.config.save_pretrained(run.hf_assets)
    (run.hf_assets / "tokenizer_config.json").write_text("{}")
    if licence is not None:
        (run.hf_assets / "LICENSE").write_text(licence)
        (run.hf_assets / "USE_POLICY.md").write_text("# Acceptable use\n")
    save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, run.step_dir(step))
    return run


def ship(src: Path, out: Path, run: Path | None = None, **kwargs: object) -> Path:
    """The consolidation job: consolidate (weights and verification only), then the report stage's card."""
    consolidate(src, out, progress=False, **kwargs)  # type: ignore[arg-type]
    assert not (out / CARD_FILE).exists()  # the consolidator writes no card
    assert main([str(out)] + (["--run-dir", str(run)] if run is not None else [])) == 0
    return out / CARD_FILE


def model_dir(tmp_path: Path, *sources: Path) -> Path:
    """A model directory whose verification.json names ``sources`` (as the consolidator records them)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / VERIFICATION_FILE).write_text(json.dumps({"ok": True, "layout": "dcp", "sources": [str(s) for s in sources]}))
    return out


# ---------------------------------------------------------------- the card of a project run
def test_card_of_a_project_run(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=True))
    card = ModelCard.load(ship(run.root, tmp_path / "out", run.root))  # huggingface_hub parses the front matter
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert data["license"] == "llama3.1" and "license_name" not in data
    assert data["tags"] == ["fsdp_workflow"]
    assert "base_model" not in data  # a local directory is not a Hub id
    assert sorted(p.name for p in licence_files(tmp_path / "out")) == ["LICENSE", "USE_POLICY.md"]
    text = card.text
    assert "| steps trained | 4 of `train.max_steps=5` |" in text
    assert "| tokens trained | 460 " in text  # 100 + 110 + 120 (the redone step 3) + 130; step 5 not consolidated
    assert "| final training loss | 2.1250 (step 4) |" in text
    assert "| held-out loss during training | 2.4000 (step 3) |" in text
    assert "| held-out perplexity | 8.500 (loss 2.1400, 512 tokens; evals.jsonl, step 4) |" in text
    assert f"`{run.config}`" in text
    assert "`/nonexistent/base`" in text and "fsdp2, 2 node(s) x 8 processes" in text
    assert "| data | `/data/sft.jsonl` (jsonl, conversation); loss on `assistant` tokens" in text
    assert "| data source | /data/sft.jsonl: counts after prepare |" in text  # named; no cache: no counts
    assert "`abc123`" in text
    assert "[LICENSE](LICENSE), [USE_POLICY.md](USE_POLICY.md)" in text
    assert f"| parameters | {tiny_model(tied=True).num_parameters():,} " in text
    assert f'AutoTokenizer.from_pretrained("{tmp_path / "out"}")' in text
    # the loss curve beside the card: matplotlib's PNG, steps 1-4 only, 800x320
    png = (tmp_path / "out" / CURVE_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 800
    assert f"![Training loss by optimizer step (eval loss as dots)]({CURVE_FILE})" in text


def test_the_card_and_status_plot_draw_with_one_function_and_label_the_axes(tmp_path, monkeypatch):
    """One renderer: the card's curve is status --plot's function; its axes say what they show."""
    assert card_mod.write_png is status_plot.write_png
    drawn = []
    real = card_mod.write_png
    monkeypatch.setattr(card_mod, "write_png", lambda s, out, **kw: drawn.append(s.steps) or real(s, out, **kw))
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    assert write_card(model_dir(tmp_path, run.step_dir(4)), open_run(run.root)) is None
    assert drawn == [[1, 2, 3, 4]]  # up to the consolidated step
    fig = curve_figure(read_series(run.metrics).up_to(4), loss_only=True)
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == (STEP_LABEL, "loss")
    full = curve_figure(read_series(run.metrics))
    assert [a.get_ylabel() for a in full.axes] == ["loss", "tokens/s", "MFU %"] and full.axes[-1].get_xlabel() == STEP_LABEL


def test_no_metrics_no_image(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    run.metrics.unlink()
    out = model_dir(tmp_path, run.step_dir(4))
    assert write_card(out, open_run(run.root)) is None
    assert (out / CARD_FILE).is_file() and not (out / CURVE_FILE).exists()


def test_facts_stop_at_the_consolidated_step_and_need_every_step_for_tokens(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False),
                   metrics=[metric(1, 3.0, 100), metric(3, 2.0, 120), metric(4, 1.75, 130)])
    facts = read_run_facts(open_run(run.root), [4])
    assert facts.final_loss == 1.75 and facts.steps_logged == 3
    assert facts.trained_tokens is None  # step 2 has no line: no total rather than a wrong one
    card = ship(run.root, tmp_path / "out", run.root).read_text()
    assert "| tokens trained | unknown (metrics.jsonl records 3 of steps 1-4) |" in card
    two = read_run_facts(open_run(run.root), [1, 3])
    assert two.final_loss == 2.0 and two.trained_tokens is None


def test_averaged_steps_report_the_last_one(tmp_path):
    model = tiny_model(tied=False)
    run = make_run(tmp_path / "run", model)
    save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, run.step_dir(3))
    card = ship(run.root, tmp_path / "out", run.root, steps=[3, 4]).read_text()
    assert "weights averaged over steps 3, 4" in card and "| final training loss | 2.1250 (step 4) |" in card


def test_licences_from_the_base_model_directory(tmp_path):
    """hf_assets/ without licence files: the card takes them, and the declared licence, from model.name_or_path."""
    base = tmp_path / "hub" / "models--Qwen--Qwen2.5-3B" / "snapshots" / "0123abc"
    base.mkdir(parents=True)
    (base / "LICENSE").write_text(QWEN)
    (base / CARD_FILE).write_text("---\nlicense: other\nlicense_name: qwen-research\nlicense_link: "
                                  "https://huggingface.co/Qwen/Qwen2.5-3B/blob/main/LICENSE\n---\n# Qwen\n")
    run = make_run(tmp_path / "run", tiny_model(tied=True), base=str(base), licence=None)
    data = ModelCard.load(ship(run.root, tmp_path / "out", run.root)).data.to_dict()
    assert data["base_model"] == "Qwen/Qwen2.5-3B"  # read from the huggingface_hub cache path
    assert data["license"] == "other" and data["license_name"] == "qwen-research"  # the base card wins
    assert data["license_link"].startswith("https://")
    assert (tmp_path / "out" / "LICENSE").read_text() == QWEN


def test_random_init_has_no_base_model(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False), licence=None, overrides=("model.init=random",))
    card = ModelCard.load(ship(run.root, tmp_path / "out", run.root))
    assert "base_model" not in card.data.to_dict() and "license" not in card.data.to_dict()
    assert "random initialisation" in card.text and "Unknown: no licence was found" in card.text


def test_the_card_names_each_source_of_a_mixture_with_the_caches_counts(tmp_path, monkeypatch):
    """data.sources: one row per source; records, tokens and shares from the prepared cache's meta.json."""
    srcs = ["+data.sources=[{path: /d/chat.jsonl, name: chat, weight: 3}, {path: /d/notes.jsonl, name: notes, weight: 1}]"]
    run = make_run(tmp_path / "run", tiny_model(tied=False), overrides=("data.path=null", *srcs))
    out = model_dir(tmp_path, run.step_dir(4))
    text = ModelCard.load(write_card(out, open_run(run.root)) or out / CARD_FILE).text
    assert "| data | mixture of 2 sources, mixed by `data.seed` (jsonl, conversation)" in text
    assert "| data source | chat (/d/chat.jsonl): weight 3 (75.0%); counts after prepare |" in text
    meta = {"mixture": True, "sources": [
        {"name": "chat", "path": "/d/chat.jsonl", "records": 40, "bad_records": 1, "train_documents": 30,
         "document_share": 0.75, "train_tokens": 3000, "token_share": 0.8},
        {"name": "notes", "path": "/d/notes.jsonl", "records": 10, "bad_records": 0, "train_documents": 10,
         "document_share": 0.25, "train_tokens": 750, "token_share": 0.2}]}
    monkeypatch.setattr("fsdp_workflow.report.run_sources.cache_meta", lambda record: meta)
    assert write_card(out, open_run(run.root)) is None
    text = (out / CARD_FILE).read_text()
    assert ("| data source | chat (/d/chat.jsonl): 30 documents (75.0%), 3,000 tokens (80.0%), 40 records read, "
            "1 bad |") in text
    assert "| data source | notes (/d/notes.jsonl): 10 documents (25.0%), 750 tokens (20.0%)" in text


# ---------------------------------------------------------------- not a project run
def test_card_of_a_plain_dcp_checkpoint_invents_nothing(tmp_path):
    model = tiny_model(tied=False)
    ref = tmp_path / "base"
    model.config.save_pretrained(ref)
    cfg = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "meta-llama/Llama-3.1-8B"}))
    (ref / "LICENSE.txt").write_text(APACHE)
    src = save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, tmp_path / "ckpt" / "step-7")
    card = ModelCard.load(ship(src, tmp_path / "out", reference=ref))
    data = card.data.to_dict()
    assert data["base_model"] == "meta-llama/Llama-3.1-8B" and data["license"] == "apache-2.0"
    assert f"`{src}`" in card.text
    assert "| training facts | unknown (no fsdp_workflow run directory was named: --run-dir) |" in card.text
    assert "loss" not in card.text and "tokens trained" not in card.text
    assert "AutoModelForCausalLM.from_pretrained" in card.text and "AutoTokenizer" not in card.text


def test_card_without_reference_or_run(tmp_path):
    """Weights only (no config.json): no library_name, nothing but the source."""
    out = model_dir(tmp_path, tmp_path / "x" / "checkpoint-3")
    assert write_card(out, None) is None
    card = ModelCard.load(out / CARD_FILE)
    assert card.data.to_dict() == {"tags": ["fsdp_workflow"]}
    assert "| base model | unknown |" in card.text and "| checkpoint | step 3 |" in card.text
    assert "## Use" not in card.text


def test_a_broken_run_directory_still_gives_a_card(tmp_path):
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    run.config.write_text("model: [unclosed\n")  # not YAML
    run.metrics.write_text("\x00garbage\n[1, 2]\n{\"step\": \"four\"}\n")
    run.evals_file.unlink()
    run.evals_file.mkdir()  # a directory where the file belongs
    out = model_dir(tmp_path, run.step_dir(4))
    assert write_card(out, open_run(run.root)) is None
    text = (out / CARD_FILE).read_text()
    assert "| final training loss | unknown |" in text and "| tokens trained | unknown (metrics.jsonl records 0" in text
    assert "| data | unknown |" in text


def test_write_card_reports_instead_of_raising(tmp_path):
    note = write_card(tmp_path / "missing" / "out", None)
    assert note is not None and note.startswith("model card not written: FileNotFoundError")


@pytest.mark.parametrize("bad", ["run", "model"])
def test_the_card_command_refuses_a_wrong_path_with_exit_2_and_writes_nothing(tmp_path, capsys, bad):
    run = make_run(tmp_path / "run", tiny_model(tied=False))
    out = model_dir(tmp_path, run.step_dir(4))
    if bad == "run":
        shutil.rmtree(run.root / "checkpoints")
        argv = [str(out), "--run-dir", str(run.root / "checkpoints")]
    else:
        argv = [str(tmp_path / "nope"), "--run-dir", str(run.root)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("not a run directory (no config.yaml)" if bad == "run" else "no such model directory") in err
    assert not (out / CARD_FILE).exists()


def test_the_plan_passes_the_run_directory_and_the_models_to_the_card(tmp_path):
    """consolidate.sbatch and the local chain run the card with paths the plan knows, never guessed."""
    import sys

    from fsdp_workflow.config.load import compose
    from fsdp_workflow.plan.spec import build_plan

    root = tmp_path / "run dir"
    plan = build_plan(compose(["+experiment=smoke", f"run_dir={root}", "train.ema_decay=0.9"]))
    assert plan.consolidate is not None and plan.consolidate.after_argvs == [
        [sys.executable, "-m", "fsdp_workflow.report.card", str(plan.layout.hf_model_ema),
         str(plan.layout.hf_model), "--run-dir", str(plan.layout.root)]]
    off = build_plan(compose(["+experiment=smoke", f"run_dir={root}", "consolidate.enabled=false"]))
    assert off.consolidate is None
