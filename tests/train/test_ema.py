"""EMA of the weights (train.ema_decay): the rule, the sharded layout, exact resume, consolidation, validation.

One 2-rank gloo FSDP2 run (session fixture ``ema_run`` of tests/conftest.py: 6 steps, a
checkpoint every step, async saves; tests/evaluate evaluates the same run) serves the
reference, layout and consolidation tests; the resume test adds one run of 3 steps. The rest runs in this process in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from fsdp_workflow.config.load import compose, load_run_config
from fsdp_workflow.core.rundir import RunDir
from fsdp_workflow.plan.checks import check as validate
from fsdp_workflow.train.ema import EmaState
from tests.conftest import EMA_DECAY, EMA_EVERY, EMA_START, EMA_STEPS
from tests.train.conftest import copy_run
from tests.train.runner import launched, log_text

DECAY, EVERY, START, STEPS = EMA_DECAY, EMA_EVERY, EMA_START, EMA_STEPS


def reference_ema(weights: list[dict[str, torch.Tensor]], decay: float, every: int, start: int) -> dict[str, torch.Tensor]:
    """The documented rule, in one process: ``weights[s]`` are the weights after optimizer step ``s`` (0: initial)."""
    ema = {k: v.double() for k, v in weights[0].items()}
    for s in range(1, len(weights)):
        if s <= start:
            ema = {k: v.double() for k, v in weights[s].items()}
        elif s % every == 0:
            ema = {k: decay * ema[k] + (1 - decay) * weights[s][k].double() for k in ema}
    return ema


def load_root(run: Path, step: int, root: str) -> dict[str, torch.Tensor]:
    """The full tensors under ``root.`` of checkpoint ``step-N``, gathered in this process, root stripped."""
    import torch.distributed.checkpoint as dcp

    path = str(run / "checkpoints" / f"step-{step}")
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith(root + ".") and hasattr(v, "size")}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return {k[len(root) + 1:]: v for k, v in sd.items()}


@pytest.mark.slow
def test_ema_equals_the_reference_from_the_logged_weights(ema_run: Path) -> None:
    """At every step the saved EMA is the rule applied to the saved weights (each step's checkpoint)."""
    weights = [load_root(ema_run, s, "model") for s in range(1, STEPS + 1)]
    weights.insert(0, weights[0])  # step 1 runs at lr 0 (warmup): the weights are still the initial ones
    for step in range(1, STEPS + 1):
        got = load_root(ema_run, step, "ema")
        want = reference_ema(weights[:step + 1], DECAY, EVERY, START)
        assert set(got) == set(want) and len(got) > 20
        assert all(v.dtype == torch.float32 for v in got.values())
        worst = max((got[k].double() - want[k]).abs().max().item() for k in want)
        assert worst < 1e-6, (step, worst)
    # The weights moved: the EMA lags them (it is no copy) once updates began.
    final = load_root(ema_run, STEPS, "ema")
    assert max((final[k] - weights[STEPS][k]).abs().max().item() for k in final) > 1e-3


@pytest.mark.slow
def test_ema_is_sharded_like_the_weights(ema_run: Path) -> None:
    md = FileSystemReader(str(ema_run / "checkpoints" / f"step-{STEPS}")).read_metadata().state_dict_metadata
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
        model, ema = md[f"model.model.{name}"], md[f"ema.model.{name}"]
        assert tuple(ema.size) == tuple(model.size)
        assert sorted(tuple(c.sizes) for c in ema.chunks) == sorted(tuple(c.sizes) for c in model.chunks)
        assert len(ema.chunks) == 2  # one shard per rank: nothing was gathered
    assert {k.removeprefix("ema.") for k in md if k.startswith("ema.")} == \
           {k.removeprefix("model.") for k in md if k.startswith("model.")}


@pytest.mark.slow
def test_resume_is_exact_for_the_ema(ema_run: Path, tmp_path: Path) -> None:
    """Stop at step 3 (between two updates), resume, and the EMA at step 6 equals the straight run's bit for bit."""
    run = copy_run(ema_run, tmp_path / "resumed", checkpoints=(3,))
    launched(run)
    assert "resumed from" in log_text(run)
    a, b = load_root(ema_run, STEPS, "ema"), load_root(run, STEPS, "ema")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_planned_consolidations_write_both_models_and_they_load(ema_run: Path, tmp_path: Path) -> None:
    """The plan's two consolidation commands, run as the local route runs them (this interpreter, EMA first),
    write hf_model_ema/ and hf_model/; both verify and load in transformers, with finite logits that differ.

    (The Slurm chain runs the same commands in consolidate.sbatch: tests/slurm/test_pipeline.py.)
    """
    from transformers import AutoModelForCausalLM

    from fsdp_workflow.backends.local import _this_python
    from fsdp_workflow.plan.spec import build_plan

    run = copy_run(ema_run, tmp_path / "run", checkpoints=(STEPS,))
    cfg = load_run_config(run)
    cfg.run_dir = str(run)  # the copy's config still names its source
    plan = build_plan(cfg)
    assert plan.consolidate is not None
    for argv in (*plan.consolidate.before_argvs, plan.consolidate.argv):
        proc = subprocess.run(_this_python(argv), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    layout = RunDir.of(run)
    ids = torch.arange(32).view(1, 32) % 260
    logits = {}
    for out in (layout.hf_model, layout.hf_model_ema):
        assert json.loads((out / "verification.json").read_text()).get("ok") is True
        logits[out.name] = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        assert torch.isfinite(logits[out.name]).all()
    assert not torch.allclose(logits["hf_model"], logits["hf_model_ema"], atol=1e-3)
    # The EMA model holds the checkpoint's EMA (bf16 output: compared at bf16).
    ema = load_root(ema_run, STEPS, "ema")["model.layers.0.mlp.up_proj.weight"]
    got = AutoModelForCausalLM.from_pretrained(layout.hf_model_ema).state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(got, ema.to(got.dtype))


def test_rule_warmup_then_every_k_steps() -> None:
    """A plain module in this process: exact tracking up to start_step, then one update every k steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ema = EmaState(model, decay=0.8, every_steps=3, start_step=2)
    weights = [{k: v.clone() for k, v in model.state_dict().items()}]
    for step in range(1, 9):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        ema.after_optimizer_step(step)
        want = reference_ema(weights, 0.8, 3, 2)
        got = ema.state_dict()
        assert all(torch.allclose(got[k].double(), want[k], atol=1e-6) for k in want), step
    assert not torch.equal(ema.state_dict()["0.weight"], model[0].weight)


def test_tied_weights_are_averaged_once_and_saved_under_both_names() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    ema = EmaState(model, decay=0.5)
    sd = ema.state_dict()
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    ema.after_optimizer_step(1)  # applied twice, the EMA would have moved by 0.75
    assert torch.allclose(sd["lm_head.weight"] - model.model.embed_tokens.weight, torch.full_like(sd["lm_head.weight"], -0.5))


def test_checkpoint_without_ema_restarts_it_from_the_loaded_weights(tmp_path: Path, capsys) -> None:
    """Turning the EMA on for a run whose checkpoints predate it: the EMA starts from the resumed weights."""
    from fsdp_workflow.train.checkpoint import CheckpointDir
    from fsdp_workflow.train.checkpointers import DcpCheckpointer
    from fsdp_workflow.train.state import ModelState

    model = torch.nn.Linear(4, 4)
    run = RunDir.of(tmp_path / "run")
    ckpt = DcpCheckpointer(CheckpointDir(run, keep_last=0, rank=0))
    ckpt.save(1, {"model": ModelState(model)}, blocking=True)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    ema = EmaState(model, decay=0.9)
    ckpt.load(run.step_dir(1), {"model": ModelState(model), "ema": ema})
    assert torch.equal(model.weight, saved) and torch.equal(ema.state_dict()["weight"], saved)
    assert "holds no 'ema'" in capsys.readouterr().err
    # And back: a checkpoint with an EMA resumes without one (train.ema_decay=null drops it).
    ckpt.save(2, {"model": ModelState(model), "ema": ema}, blocking=True)
    ckpt.load(run.step_dir(2), {"model": ModelState(model)})


def test_ddp_names_drop_the_wrapper(tmp_path: Path) -> None:
    """Under DDP every rank keeps a full copy, named as the model part names it (no ``module.``)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
        ema = EmaState(model, decay=0.9)
        assert set(ema.state_dict()) == set(get_model_state_dict(model)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides, key, words", [
    (["train.ema_decay=1.0"], "train.ema_decay", "in (0, 1)"),
    (["train.ema_decay=0"], "train.ema_decay", "in (0, 1)"),
    (["train.ema_decay=-0.5"], "train.ema_decay", "in (0, 1)"),
    (["train.ema_decay=0.99", "strategy=deepspeed_zero3", "cluster.device=cuda"], "train.ema_decay",
     "not implemented for deepspeed"),
    (["train.ema_decay=0.99", "strategy=fsdp1", "cluster.device=cuda"], "train.ema_decay", "not implemented for fsdp1"),
    (["train.ema_every_steps=4"], "train.ema_every_steps", "no effect without an EMA"),
    (["train.ema_decay=0.99", "train.ema_every_steps=0"], "train.ema_every_steps", ">= 1"),
])
def test_validation_refuses(overrides: list[str], key: str, words: str) -> None:
    report = validate(compose(["+experiment=smoke", "dry_run=true", *overrides]))
    found = [i for i in report.errors if i.key == key]
    assert found and words in found[0].why, [i.format() for i in report.errors]


def test_validation_accepts_fsdp2_and_ddp() -> None:
    for strategy in ("fsdp2", "ddp"):
        report = validate(compose(["+experiment=smoke", "dry_run=true", f"strategy={strategy}", "train.ema_decay=0.999",
                                   "train.ema_every_steps=4", "train.ema_start_step=100"]))
        assert not [i for i in report.errors if i.key.startswith("train.ema")], report.errors


def test_consolidation_job_writes_the_ema_first(tmp_path: Path) -> None:
    """consolidate.sbatch: the EMA (--subtree ema, never --remove-sharded) then the model (--subtree model).

    The model's step is not ``exec``'d: the job's EXIT trap writes its exit record and removes staging."""
    from fsdp_workflow.backends.slurm.scripts import render_all
    from fsdp_workflow.plan.spec import build_plan

    cfg = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", "dry_run=true",
                   "train.ema_decay=0.99", "consolidate.remove_sharded=true", f"run_dir={tmp_path / 'run'}"])
    text = render_all(build_plan(cfg))["consolidate.sbatch"]
    lines = [line for line in text.splitlines() if "fsdp_workflow.consolidate" in line]
    assert len(lines) == 2, text
    assert "hf_model_ema" in lines[0] and "--subtree ema" in lines[0] and "--remove-sharded" not in lines[0]
    assert not lines[1].startswith("exec ") and "--subtree model" in lines[1] and "--remove-sharded" in lines[1]
    off = compose(["+experiment=smoke", "cluster=slurm", "cluster.partition=debug", "dry_run=true",
                   f"run_dir={tmp_path / 'off'}"])
    assert "--subtree" not in render_all(build_plan(off))["consolidate.sbatch"]
