"""Write DCP checkpoints the way ``FileSystemWriter`` does, for benchmarks and tests.

Produces the same bytes a multi-rank ``dcp.save`` would (``torch.save`` of each chunk,
appended to ``__R_0.distcp``; a pickled ``Metadata``), without starting processes, for any
mesh: dimension 0 split over ``dp`` ranks and, optionally, dimension ``tp_dim`` over ``tp``
ranks, with ``replicas`` copies of every chunk listed in the metadata (as an un-deduplicated
2-D mesh would). Imports torch; the consolidator itself never imports this module.

Usage::

    python -m fsdp_workflow.consolidate.synthetic OUT_DIR --gb 1.5 --ranks 2
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdp_workflow.core.rundir import CHECKPOINTS_DIR, DCP_METADATA, HF_ASSETS_DIR, step_name


def _splits(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk-style split of ``n`` into (offset, size) pieces, dropping empty ones."""
    step = -(-n // parts)
    return [(o, min(step, n - o)) for o in range(0, n, step)] if n else [(0, 0)]


def write_dcp(
    path: Path,
    tensors: Iterable[tuple[str, tuple, torch.dtype]],
    make: Callable[[str, tuple, tuple, torch.dtype], torch.Tensor],
    *,
    dp: int = 2,
    tp: int = 1,
    tp_dim: int = 1,
    replicas: int = 1,
    bytes_items: dict[str, object] | None = None,
) -> None:
    """Write a DCP checkpoint.

    Args:
        path: Directory to create.
        tensors: (fqn, global shape, dtype) of each tensor.
        make: ``make(fqn, offsets, sizes, dtype)`` returns the chunk's values.
        dp: Ranks splitting dimension 0.
        tp: Ranks splitting ``tp_dim`` (for tensors with that many dimensions).
        replicas: How many times each chunk is listed in the metadata.
        bytes_items: Non-tensor entries (key -> object), ``torch.save``d like DCP's BYTE_IO items.
    """
    path.mkdir(parents=True, exist_ok=True)
    world = dp * tp
    files = [open(path / f"__{r}_0.distcp", "wb") for r in range(world)]
    sd_meta: dict = {}
    storage: dict = {}
    try:
        for fqn, shape, dtype in tensors:
            chunks = []
            dims0 = _splits(shape[0], dp) if shape else [(0, 0)]
            dims1 = _splits(shape[tp_dim], tp) if len(shape) > tp_dim and tp > 1 else [(0, shape[tp_dim] if len(shape) > tp_dim else 0)]
            rank = 0
            for o0, s0 in dims0:
                for o1, s1 in dims1:
                    offsets, sizes = [0] * len(shape), list(shape)
                    if shape:
                        offsets[0], sizes[0] = o0, s0
                    if len(shape) > tp_dim and tp > 1:
                        offsets[tp_dim], sizes[tp_dim] = o1, s1
                    f = files[rank % world]
                    rank += 1
                    start = f.tell()
                    torch.save(make(fqn, tuple(offsets), tuple(sizes), dtype).contiguous(), f)
                    idx = MetadataIndex(fqn, offsets)
                    storage[idx] = _StorageInfo(f"__{(rank - 1) % world}_0.distcp", start, f.tell() - start)
                    chunks += [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))] * replicas
            sd_meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        for key, obj in (bytes_items or {}).items():
            buf = io.BytesIO()
            torch.save(obj, buf)
            raw = buf.getvalue()
            f = files[0]
            start = f.tell()
            f.write(raw)
            storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", start, len(raw))
            sd_meta[key] = BytesStorageMetadata()
    finally:
        for f in files:
            f.close()
    with open(path / DCP_METADATA, "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sd_meta, storage_data=storage, version="1.0.0"), f)


def llama_shapes(num_layers: int, hidden: int = 2048, inter: int = 5632, vocab: int = 32000) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama parameter names and shapes (full multi-head attention, untied)."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter)), (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def llama_config(num_layers: int, hidden: int = 2048, inter: int = 5632, vocab: int = 32000, dtype: str = "bfloat16") -> dict:
    return {
        "architectures": ["FSDPLlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": num_layers, "num_attention_heads": hidden // 128,
        "num_key_value_heads": hidden // 128, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": dtype, "hidden_act": "silu",
    }


def random_chunk(fqn: str, offsets: tuple, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((fqn, offsets)) & 0xFFFFFFFF)
    return torch.randn(sizes, generator=g, dtype=torch.float32).to(dtype)


def write_llama_run(run_dir: Path, gb: float, ranks: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A run directory (``checkpoints/step-1`` + ``hf_assets``) of a Llama-shaped model of about ``gb`` GB."""
    per_layer = 4 * 2048 * 2048 + 3 * 2048 * 5632
    fixed = 2 * 32000 * 2048
    layers = max(1, round((gb * 1e9 / dtype.itemsize - fixed) / per_layer))
    ckpt = run_dir / CHECKPOINTS_DIR / step_name(1)
    specs = [("model." + n, s, dtype) for n, s in llama_shapes(layers)]
    write_dcp(ckpt, specs, random_chunk, dp=ranks)
    (run_dir / HF_ASSETS_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / HF_ASSETS_DIR / "config.json").write_text(json.dumps(llama_config(layers, dtype=str(dtype).split(".")[-1]), indent=2))
    return ckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--gb", type=float, default=1.5)
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    print(write_llama_run(a.out, a.gb, a.ranks))


if __name__ == "__main__":
    main()
