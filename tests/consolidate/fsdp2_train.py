"""Train tiny HF causal LMs with FSDP2 on CPU and save them like the project trainer.

The session fixture in ``conftest.py`` runs :func:`main` on 2 ranks forked from a
preloaded server (tests/forked_ranks.py); by hand::

    torchrun --nproc_per_node 2 tests/consolidate/fsdp2_train.py OUT_ROOT llama qwen2 mistral

For each model it writes ``OUT_ROOT/<name>/`` in the project layout::

    checkpoints/step-2/, checkpoints/step-4/   dcp.save of {"model", "optimizer", "scheduler", "trainer"}
    checkpoints/step-6.tmp-123/                 an unfinished save, to be ignored
    hf_assets/                                  config.json, generation_config.json, tokenizer files
    expected/step-2.safetensors, step-4...      full state dicts gathered on rank 0, for exact comparison

and ``OUT_ROOT/dtensor/``: a DCP checkpoint of DTensors placed Shard(1), unevenly
Shard(0) and Replicate(), with ``expected.safetensors`` beside it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

VOCAB = 96


def tiny_config(kind: str):
    """Return a tiny transformers config for ``kind`` (no download)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=16)
    raise ValueError(kind)


def save_assets(model, assets: Path) -> None:
    """Write config, generation config and a small word-level tokenizer with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.config.save_pretrained(assets)
    model.generation_config.save_pretrained(assets)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(VOCAB - 3)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(assets)


def full_state(model) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def train_one(kind: str, root: Path, rank: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(kind)
    dtype = torch.bfloat16 if kind == "mistral" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(1234 + rank)
    run = root / kind
    for step in range(1, 5):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 2 == 0:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "trainer": {"step": step}}
            dcp.save(state, checkpoint_id=str(run / "checkpoints" / f"step-{step}"))
            full = full_state(model)
            if rank == 0:
                (run / "expected").mkdir(parents=True, exist_ok=True)
                save_file(full, str(run / "expected" / f"step-{step}.safetensors"))
    if rank == 0:
        save_assets(model, run / "hf_assets")
        junk = run / "checkpoints" / "step-6.tmp-123"
        junk.mkdir()
        (junk / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()


def save_dtensors(root: Path, rank: int) -> None:
    """Chunks that split dim 1, uneven chunks and replicated tensors."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(7)
    full = {
        "w_shard1": torch.randn(4, 6),
        "w_uneven": torch.randn(5, 3),
        "w_repl": torch.arange(10, dtype=torch.int64),
        "w_bf16": torch.randn(3, 8).to(torch.bfloat16),
    }
    placements = {"w_shard1": Shard(1), "w_uneven": Shard(0), "w_repl": Replicate(), "w_bf16": Shard(1)}
    sd = {k: distribute_tensor(v, mesh, [placements[k]]) for k, v in full.items()}
    dcp.save({"model": sd}, checkpoint_id=str(root / "dtensor" / "ckpt"))
    if rank == 0:
        save_file(full, str(root / "dtensor" / "expected.safetensors"))
    dist.barrier()


def main(root: str, kinds: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for kind in kinds:
        train_one(kind, Path(root), rank)
    save_dtensors(Path(root), rank)
    dist.destroy_process_group()


if __name__ == "__main__":  # by hand, under torchrun (the tests fork the ranks: tests/consolidate/conftest.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1], sys.argv[2:])
