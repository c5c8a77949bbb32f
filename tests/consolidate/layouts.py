"""Build the checkpoint layouts of other tools from the trained tensors (single process)."""

from __future__ import annotations

import io
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import StreamTransformExtension

from fsdp_workflow.consolidate.synthetic import write_dcp


def save(state: dict, path: Path, extensions: list | None = None) -> Path:
    writer = dcp.FileSystemWriter(str(path), _extensions=extensions)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return path


def accelerate(run: Path, root: Path) -> Path:
    """``save_state`` output: pytorch_model_fsdp_0/ (+ EMA from step 2), optimizer_0/, random_states_0.pkl."""
    shutil.copytree(run / "checkpoints" / "step-4", root / "pytorch_model_fsdp_0")
    shutil.copytree(run / "checkpoints" / "step-2", root / "pytorch_ema_model_fsdp_0")
    shutil.copytree(run / "checkpoints" / "step-4", root / "optimizer_0")
    (root / "random_states_0.pkl").write_bytes(b"not read")
    return root


def hf_trainer(run: Path, root: Path) -> Path:
    """``OUTPUT/checkpoint-N/pytorch_model_fsdp_0`` with config and tokenizer beside it."""
    for step in (2, 4):
        ck = root / f"checkpoint-{step}"
        shutil.copytree(run / "checkpoints" / f"step-{step}", ck / "pytorch_model_fsdp_0")
        for f in (run / "hf_assets").iterdir():
            shutil.copy(f, ck / f.name)
    return root


def torchtitan(tensors: dict[str, torch.Tensor], root: Path) -> Path:
    """Model keys at top level beside flattened optimizer state and train_state bytes."""
    state = {k: v.clone() for k, v in tensors.items()}
    state["optimizer"] = {f"state.{k}.exp_avg": torch.zeros_like(v) for k, v in tensors.items()}
    state["train_state"] = io.BytesIO(b"step=4")
    state["lr_schedulers"] = {"last_epoch": 4}
    return save(state, root / "step-4")


def lightning(tensors: dict[str, torch.Tensor], root: Path, meta: object) -> Path:
    """Lightning FSDP sharded save: {"model": ...} shards plus meta.pt."""
    path = save({"model": {k: v.clone() for k, v in tensors.items()}}, root / "epoch=0-step=4.ckpt")
    torch.save(meta, path / "meta.pt")
    return root


def nemo2(tensors: dict[str, torch.Tensor], root: Path) -> Path:
    """NeMo 2 checkpoint dir: weights/ (DCP, keys under ``module.``) and context/."""
    save({"module": {k: v.clone() for k, v in tensors.items()}}, root / "weights")
    (root / "context").mkdir()
    (root / "context" / "model.yaml").write_text("_target_: nemo.collections.llm.GPTModel\n")
    return root


def mesh_2d(tensors: dict[str, torch.Tensor], path: Path, wrapped: bool = True) -> Path:
    """4 ranks (dp=2 x tp=2), dim 1 split by TP, every chunk listed twice (replicas), FSDP1-style names."""
    def fqn(k: str) -> str:
        if not wrapped:
            return "model." + k
        parts = k.split(".")
        return "model." + ".".join(["_fsdp_wrapped_module", "_orig_mod"] + parts[:2] + ["_checkpoint_wrapped_module"] + parts[2:])

    names = {fqn(k): k for k in tensors}

    def make(name, offsets, sizes, dtype):
        t = tensors[names[name]]
        return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()

    write_dcp(path, [(f, tuple(tensors[k].shape), tensors[k].dtype) for f, k in names.items()], make, dp=2, tp=2, replicas=2)
    return path


class ZlibTransform(StreamTransformExtension):
    """A stream transform like DCP's zstd one (zstandard is not installed here)."""

    @staticmethod
    def registry_name() -> str:
        return "stream.test-zlib"

    @staticmethod
    def from_descriptor(version: str) -> "ZlibTransform":
        return ZlibTransform()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class W(io.RawIOBase):
            def __init__(self):
                self.c = zlib.compressobj()

            def writable(self):
                return True

            def write(self, b):
                output.write(self.c.compress(bytes(b)))
                return len(b)

            def close(self):
                if not self.closed:
                    output.write(self.c.flush())
                super().close()

        return W()

    def transform_from(self, input):
        return io.BytesIO(zlib.decompress(input.read()))
