"""Tied input and output embeddings (``model.tie_word_embeddings=true``) under every CPU strategy.

The tiny Llama tied, as Llama 3.2 1B/3B, Qwen2.5 <= 3B, Qwen3 <= 4B, Gemma and SmolLM
ship. Before the fix the default strategy (FSDP2 with ``cpu_ram_efficient_loading``)
died on both ranks: the ranks that build on meta (Accelerate's ``init_empty_weights``)
lost the tie, so rank 0 sharded one parameter fewer than the others (gloo's
"76864 vs 38464"). Three 2-rank gloo runs of 4 steps, a checkpoint at every step: the
default strategy (shared by the tie, optimizer and consolidation tests), FSDP2 building
on every rank, and DDP. The rest runs in this process in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from fsdp_workflow.config.load import compose
from fsdp_workflow.train import model as model_lib
from tests.train.runner import launched, log_text, losses, make_run_dir

STEPS = 4
TIED = ["model.tie_word_embeddings=true", f"train.max_steps={STEPS}", "checkpoint.every_steps=1",
        "checkpoint.keep_last=0", "optimizer.lr=3e-3", "optimizer.warmup_steps=1"]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def load_model_tensors(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The full model tensors of checkpoint ``step-N`` (HF names), gathered in this process."""
    import torch.distributed.checkpoint as dcp

    path = str(run / "checkpoints" / f"step-{step}")
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith("model.") and hasattr(v, "size")}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return {k.removeprefix("model."): v for k, v in sd.items()}


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tied run per CPU strategy path (the default first: its failure names the bug)."""
    root = tmp_path_factory.mktemp("tied")
    paths = {"fsdp2 lazy": [], "fsdp2 eager": ["strategy.cpu_ram_efficient_loading=false"], "ddp": ["strategy=ddp"]}
    return {name: launched(make_run_dir(root / name.replace(" ", "_"), [*TIED, *extra]))
            for name, extra in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fsdp2 lazy", "fsdp2 eager", "ddp"])
def test_tied_model_trains_and_stays_tied_at_every_step(tied_runs: dict[str, Path], path: str) -> None:
    """Each strategy path trains the tied model as ONE tensor: the trainer says so, and the saved
    output embedding equals the input embedding bit for bit at every step while both move.
    Two parameters would drift apart from step 2 (their gradients differ)."""
    run = tied_runs[path]
    assert f"tied: {HEAD} is {EMBED} (one parameter, trained once)" in log_text(run)
    steps = [load_model_tensors(run, s) for s in range(1, STEPS + 1)]
    for step, tensors in enumerate(steps, start=1):
        assert torch.equal(tensors[HEAD], tensors[EMBED]), (path, step)
    assert not torch.equal(steps[0][EMBED], steps[-1][EMBED])  # trained, not frozen
    loss = losses(run)
    assert sorted(loss) == list(range(1, STEPS + 1)) and loss[STEPS] < loss[1], loss


@pytest.mark.slow
def test_tied_weight_has_one_optimizer_state(tied_runs: dict[str, Path]) -> None:
    """The optimizer holds one state for the tied tensor (two would mean two parameters)."""
    md = FileSystemReader(str(tied_runs["fsdp2 lazy"] / "checkpoints" / f"step-{STEPS}")).read_metadata()
    keys = set(md.state_dict_metadata)
    assert f"optimizer.state.{EMBED}.exp_avg" in keys
    assert f"optimizer.state.{HEAD}.exp_avg" not in keys


@pytest.mark.slow
def test_consolidated_model_keeps_the_tie_and_the_logits(tied_runs: dict[str, Path], tmp_path: Path) -> None:
    """``python -m fsdp_workflow.consolidate RUN OUT`` writes what ``save_pretrained`` writes for a
    tied model (``tie_word_embeddings: true``, one tensor for both), and ``from_pretrained`` of it
    is the trained model: the same logits, exactly, as the checkpoint's tensors loaded into it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    run, out = tied_runs["fsdp2 lazy"], tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "fsdp_workflow.consolidate", str(run), str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert EMBED in names and HEAD not in names
    report = json.loads((out / "verification.json").read_text())
    assert report["tied_lm_head"] == {"dropped": HEAD, "kept": EMBED, "identical": True}

    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out))).eval()
    result = trained.load_state_dict(load_model_tensors(run, STEPS), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(0, loaded.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)


def test_meta_build_keeps_the_tie() -> None:
    """The root cause, in one process: a model built on meta (as every rank but 0 builds it under
    ``cpu_ram_efficient_loading``) has the same parameters as one built for real, tie included."""
    cfg = compose(["+experiment=smoke", "model.tie_word_embeddings=true"]).model
    real = model_lib.build_model(cfg, seed=0)
    meta = model_lib.build_model(cfg, seed=0, meta=True)
    shapes = lambda m: sorted((n, tuple(p.shape)) for n, p in m.named_parameters())  # noqa: E731
    assert shapes(meta) == shapes(real)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert model_lib.tied_parameter_names(meta) == [(HEAD, EMBED)]
    assert model_lib.untied(meta) == []


def test_moving_to_meta_loses_the_tie_and_retie_restores_it() -> None:
    """``untied`` sees what ``Module.to`` does to a tie (each module gets its own copy), and ``retie``
    (what the trainer calls after such a step) makes it one parameter again. An untied config has none."""
    cfg = compose(["+experiment=smoke", "model.tie_word_embeddings=true"]).model
    model = model_lib.build_model(cfg, seed=0).to("meta")
    assert model_lib.untied(model) == [f"{HEAD} -> {EMBED}"]
    model_lib.retie(model)
    assert model_lib.untied(model) == [] and model.lm_head.weight is model.model.embed_tokens.weight
    plain = model_lib.build_model(compose(["+experiment=smoke"]).model, seed=0, meta=True)
    assert model_lib.tied_parameter_names(plain) == [] and model_lib.untied(plain) == []
