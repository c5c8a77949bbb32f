"""The logged loss of a bf16 run is reduced in fp32, never through the model's output dtype (issue 36, item 2).

Real 2-rank gloo runs with ``train.mixed_precision=bf16`` on both CPU paths: our own
``fully_shard`` (``strategy=fsdp2``: bf16 parameters for compute, fp32 master weights)
and Accelerate's DDP (``strategy=ddp``: fp32 parameters under Accelerate's bf16 autocast).
Two micro-batches per step on each rank, a checkpoint after every step. Then, in this
process, every logged loss is recomputed from the weights it was computed with (the
seeded initial model for step 1, ``step-(k-1)`` for step k) on each rank's micro-batches
of that step, in the same bf16 compute, with the sums kept in fp32 and divided by the
step's trained tokens. The logged losses equal that within 1e-5 (relative), while the
same sums rounded to bf16, as FSDP2's root ``output_dtype`` used to hand them back
(commit 62404d0), would be off by more, and no logged loss is a bf16 value.

Accelerate's FSDP2 path needs CUDA: ``test_accelerate_fsdp2_root_hands_back_fp32_sums``
runs Accelerate's own wrapping function on one CPU rank instead.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_workflow.config.load import compose, load_run_config
from fsdp_workflow.data.tokenizer import load_tokenizer
from fsdp_workflow.train import model as model_lib
from fsdp_workflow.train.data import RankBatches, open_sources, pad_token_id
from fsdp_workflow.train.loss import install_loss_forward
from fsdp_workflow.train.safe_load import SafeFileSystemReader, SafeLoadPlanner
from tests.train.runner import launched, make_run_dir

STEPS, RANKS, ACCUM = 3, 2, 2


def bf16_exact(x: float) -> bool:
    """``x`` is a bf16 value: its float32 bits have the low 16 bits zero (and it is a float32 at all)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return (bits & 0xFFFF) == 0 and struct.unpack("<f", struct.pack("<f", x))[0] == x


def _model_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` tensors of a DCP checkpoint, loaded in this one process (fp32 master weights)."""
    md = SafeFileSystemReader(str(step_dir)).read_metadata()
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(step_dir)), planner=SafeLoadPlanner(), no_dist=True)
    return {k[len("model."):]: v for k, v in state.items()}


def _recomputed_sums(run: Path, strategy: str) -> tuple[list[list[float]], list[int]]:
    """Per step: each micro-batch's summed cross-entropy (fp32, every rank), and the step's trained tokens."""
    cfg = load_run_config(run / "config.yaml")
    net = model_lib.build_model(cfg.model, seed=cfg.train.seed)
    install_loss_forward(net)
    train_src, _ = open_sources(cfg, pad_token_id(load_tokenizer(cfg.model)))
    feeds = [RankBatches(train_src, cfg.train.micro_batch_size, r, RANKS) for r in range(RANKS)]
    sums, trained = [], []
    for step in range(1, STEPS + 1):
        if step > 1:
            net.load_state_dict(_model_weights(run / "checkpoints" / f"step-{step - 1}"))
        if strategy == "fsdp2":  # FSDP2's policy: parameters (not buffers) cast to bf16 for compute
            compute = model_lib.build_model(cfg.model, seed=cfg.train.seed)
            compute.load_state_dict(net.state_dict())
            for p in compute.parameters():
                p.data = p.data.to(torch.bfloat16)
            install_loss_forward(compute)
            context = contextlib.nullcontext()
        else:  # Accelerate's DDP: fp32 parameters under bf16 autocast
            compute, context = net, torch.autocast("cpu", dtype=torch.bfloat16)
        batches = [feed.next() for feed in feeds for _ in range(ACCUM)]
        with torch.no_grad(), context:
            out = [compute(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids).ce for b in batches]
        assert all(t.dtype == torch.float32 for t in out)
        sums.append([t.item() for t in out])
        trained.append(sum(int(b.num_trained()) for b in batches))
    return sums, trained


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_the_logged_bf16_loss_is_the_fp32_reduction(strategy: str, tmp_path: Path) -> None:
    run = launched(make_run_dir(tmp_path / "run", [
        f"strategy={strategy}", "train.mixed_precision=bf16", f"train.max_steps={STEPS}",
        f"train.grad_accum_steps={ACCUM}", "checkpoint.every_steps=1", "checkpoint.keep_last=0", "optimizer.lr=1e-3",
    ]))
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert not any(bf16_exact(r["loss"]) for r in logged), [r["loss"] for r in logged]

    sums, trained = _recomputed_sums(run, strategy)
    assert [r["trained_tokens"] for r in logged] == trained
    fp32 = [sum(s) / n for s, n in zip(sums, trained)]
    as_bf16 = [sum(torch.tensor(x).bfloat16().item() for x in s) / n for s, n in zip(sums, trained)]
    for rec, want, rounded in zip(logged, fp32, as_bf16):
        assert rec["loss"] == pytest.approx(want, rel=1e-5), (rec, want)
        # bf16 sums would be told apart: the rounding moves the loss by more than the tolerance.
        assert abs(rounded - want) > 1e-5 * want, (rounded, want)


@pytest.mark.parametrize("accelerate_output", [torch.bfloat16, None], ids=["accelerate-1.15", "accelerate-1.16"])
def test_accelerate_fsdp2_root_hands_back_fp32_sums(accelerate_output) -> None:
    """Accelerate's own FSDP2 wrapping (``fsdp2_prepare_model``), as the trainer's GPU path runs it, on one
    CPU gloo rank. Accelerate's bf16 policy has changed between releases: 1.15 set ``output_dtype`` bf16
    (the root then cast the installed forward's fp32 sums to bf16), 1.16 leaves it None. Whichever
    Accelerate chose, after ``parallel.own_mixed_precision`` the sums come back fp32 and the decoder
    layers still compute and hand on bf16."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from fsdp_workflow.train.parallel import ShardOptions, own_mixed_precision

    cfg = compose(["+experiment=smoke", "train.mixed_precision=bf16"])
    seq = 32
    ids = torch.randint(0, cfg.model.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).expand(2, seq)

    class _Accelerator:  # what fsdp2_prepare_model reads of an Accelerator
        device, mixed_precision, is_main_process, torch_device_mesh = torch.device("cpu"), "bf16", True, None

        def __init__(self, plugin: FullyShardedDataParallelPlugin) -> None:
            self.state = type("State", (), {"fsdp_plugin": plugin})()

    def wrapped_output(fix: bool) -> tuple[torch.Tensor, torch.dtype]:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False,
                                                transformer_cls_names_to_wrap=[cfg.model.decoder_layer_cls],
                                                auto_wrap_policy="transformer_based_wrap")
        plugin.set_mixed_precision("bf16")
        # the release's choice, whichever Accelerate is installed
        plugin.mixed_precision_policy = replace(plugin.mixed_precision_policy, output_dtype=accelerate_output)
        if fix:
            own_mixed_precision(plugin, ShardOptions.of(cfg), torch.device("cpu"))
        net = model_lib.build_model(cfg.model, seed=0)
        net = fsdp2_prepare_model(_Accelerator(plugin), net)
        install_loss_forward(net)  # after prepare, as the fsdp2 strategy does
        layer_out = []
        net.model.layers[0].register_forward_hook(lambda m, i, o: layer_out.append(o[0] if isinstance(o, tuple) else o))
        out = net(input_ids=ids, labels=ids, position_ids=pos)
        return out.ce, layer_out[0].dtype

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before, _ = wrapped_output(fix=False)
        after, layer_dtype = wrapped_output(fix=True)
    finally:
        dist.destroy_process_group()
    assert before.dtype == (accelerate_output or torch.float32)  # what Accelerate's own policy gives
    assert after.dtype == torch.float32 and layer_dtype == torch.bfloat16
    assert after.item() != after.bfloat16().float().item()  # more than 8 bits
    assert abs(after.item() - before.float().item()) <= abs(after.item()) * 2 ** -8  # the same sum, rounded
