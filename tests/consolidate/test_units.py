"""Fast unit tests: key hygiene, architecture names, sizes, casting, zip parsing, metadata safety, planning."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from fsdp_workflow.core.sizes import parse_size
from fsdp_workflow.consolidate import writer
from fsdp_workflow.consolidate.casting import cast_bytes
from fsdp_workflow.consolidate.consolidation_errors import ConsolidationError, UnsafeCheckpointError
from fsdp_workflow.consolidate.key_names import fix_architecture, map_keys
from fsdp_workflow.consolidate.metadata import restricted_loads
from fsdp_workflow.consolidate.reader import Chunk, chunk_runs
from fsdp_workflow.consolidate.zipchunk import locate_chunk


def test_project_keys_strip_dcp_root_and_skip_training_state():
    keys = ["model.model.embed_tokens.weight", "model.lm_head.weight", "optimizer.state.model.x.exp_avg", "scheduler.last_epoch",
            "ema.model.embed_tokens.weight", "ema.lm_head.weight"]
    assert map_keys(keys) == {"model.embed_tokens.weight": keys[0], "lm_head.weight": keys[1]}
    # The trainer's EMA (train.ema_decay) is the model's names under "ema": taken only when asked for.
    assert map_keys(keys, subtree="ema") == {"model.embed_tokens.weight": keys[4], "lm_head.weight": keys[5]}


def test_wrapper_prefixes_removed_everywhere():
    keys = ["model._orig_mod.module.model.layers.0._checkpoint_wrapped_module.mlp.weight",
            "model._orig_mod.module._fsdp_wrapped_module.lm_head.weight"]
    assert list(map_keys(keys)) == ["model.layers.0.mlp.weight", "lm_head.weight"]


def test_tied_causal_lm_without_lm_head_keeps_model_prefix():
    keys = ["model.model.embed_tokens.weight", "model.model.layers.0.w", "model.model.norm.weight"]
    assert list(map_keys(keys)) == ["model.embed_tokens.weight", "model.layers.0.w", "model.norm.weight"]
    plain = ["model.embed_tokens.weight", "model.layers.0.w"]
    assert list(map_keys(plain)) == plain


def test_subtree_and_collisions():
    keys = ["ema.model.layers.0.w", "ema.lm_head.weight", "model.model.layers.0.w"]
    assert map_keys(keys, subtree="ema") == {"model.layers.0.w": keys[0], "lm_head.weight": keys[1]}
    with pytest.raises(ConsolidationError, match="no tensor keys under it.*'ema', 'model'"):
        map_keys(keys, subtree="nope")
    with pytest.raises(ConsolidationError, match="both map to 'a.w'"):
        map_keys(["a._orig_mod.w", "a.w"])


@pytest.mark.parametrize("name,want", [("FSDPPhiForCausalLM", "PhiForCausalLM"), ("PhiForCausalLM", "PhiForCausalLM"),
                                       ("FSDPLlamaForCausalLM", "LlamaForCausalLM"), ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM")])
def test_architecture_prefix_is_removed_not_lstripped(name, want):
    assert fix_architecture(name) == want


def test_parse_size_is_the_shared_config_parser():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("100KB") == 100_000
    assert parse_size("1TB") == 10**12 and parse_size("500MB") == 500 * 10**6 and parse_size(123) == 123
    assert not hasattr(writer, "parse_size")  # one parser: the planner and the consolidator agree on every value
    for bad in ("5XB", "0", "", "GB"):
        with pytest.raises(ValueError, match="expected 5GB, 500MB, 1TB, 2GiB or a byte count"):
            parse_size(bad)


@pytest.mark.parametrize("shape,offsets,sizes", [((6, 4), (2, 0), (3, 4)), ((4, 6), (0, 3), (4, 3)),
                                                   ((2, 3, 4), (1, 1, 0), (1, 2, 4)), ((5,), (3,), (2,)), ((), (), ())])
def test_chunk_runs_place_every_element(shape, offsets, sizes):
    full = torch.arange(int(np.prod(shape)) if shape else 1).reshape(shape)
    chunk = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].contiguous().reshape(-1)
    flat = full.reshape(-1)
    for src, dst, n in chunk_runs(shape, Chunk(offsets, sizes, None, 0, 0)):
        assert torch.equal(chunk[src : src + n], flat[dst : dst + n])


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float64])
def test_cast_matches_torch(dst):
    x = torch.cat([torch.randn(100_000) * 10 ** torch.linspace(-40, 37, 100_000), torch.tensor([0.0, -0.0, float("inf"), 65520.0, 1e-40])])
    got = cast_bytes(x.numpy().tobytes(), "float32", str(dst).split(".")[-1])
    want = x.to(dst).view(torch.int16 if dst.itemsize == 2 else torch.int64).numpy().tobytes()
    assert got == want
    back = cast_bytes(got, str(dst).split(".")[-1], "float32")
    assert back == x.to(dst).float().numpy().tobytes()


@pytest.mark.parametrize("t", [torch.arange(12.0).reshape(3, 4), torch.arange(12).reshape(3, 4).t(),
                               torch.arange(20, dtype=torch.bfloat16)[5:9], torch.tensor(3.5)])
def test_locate_chunk_in_torch_save_archive(tmp_path, t):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * 13)  # chunks start anywhere in a .distcp file
        torch.save(t, f)
        end = f.tell()
    fd = os.open(path, os.O_RDONLY)
    try:
        cd = locate_chunk(fd, 13, end - 13, "f")
        assert cd.shape == tuple(t.shape) and cd.dtype == str(t.dtype).split(".")[-1]
        if t.is_contiguous():
            assert cd.contiguous
            assert os.pread(fd, cd.nbytes, cd.data_offset) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            assert not cd.contiguous
    finally:
        os.close(fd)


@pytest.mark.parametrize("payload", ["os.system", "subprocess.Popen", "builtins.eval", "torch.load", "numpy.load"])
def test_restricted_unpickler_refuses_any_other_global(payload):
    mod, name = payload.rsplit(".", 1)
    data = ("c" + mod + "\n" + name + "\n").encode() + b"(S'true'\ntR."
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to unpickle global '{mod}.{name}'"):
        restricted_loads(data, "test")


def test_restricted_unpickler_reads_real_metadata_objects():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 2]),
                                              [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))])})
    got = restricted_loads(pickle.dumps(md), "m")
    t = got.state_dict_metadata["w"]
    assert t.properties.dtype.name == "bfloat16" and t.size == (4, 2) and t.chunks[0].sizes == (4, 2)


def test_load_dcp_metadata_refuses_through_the_shared_allow_list(tmp_path, monkeypatch):
    """The consolidator's unpickler is core's AllowListUnpickler: same list, same refusal, nothing run."""
    from torch.distributed.checkpoint.metadata import Metadata

    from fsdp_workflow.core import safe_pickle
    from fsdp_workflow.consolidate.metadata import RestrictedUnpickler, load_dcp_metadata

    from .test_safety import _Payload

    assert issubclass(RestrictedUnpickler, safe_pickle.AllowListUnpickler)
    marker = tmp_path / "PWNED"
    meta = Metadata({}, planner_data=_Payload(marker))
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpointError) as err:
        load_dcp_metadata(path)
    assert str(err.value) == safe_pickle.refusal(str(path), "builtins", "exec")
    assert not marker.exists()
    # The decision is the shared one: the refusal goes through AllowListUnpickler.find_class,
    # and the trainer's loader (core.load_dcp_metadata) refuses the same file.
    seen = []
    find_class = safe_pickle.AllowListUnpickler.find_class

    def recording_find_class(self, module, name):
        seen.append((module, name))
        return find_class(self, module, name)

    monkeypatch.setattr(safe_pickle.AllowListUnpickler, "find_class", recording_find_class)
    with pytest.raises(UnsafeCheckpointError):
        load_dcp_metadata(path)
    assert ("builtins", "exec") in seen
    with pytest.raises(safe_pickle.UnsafePickleError, match="builtins.exec"):
        safe_pickle.load_dcp_metadata(path)
    assert not marker.exists()


def test_every_shared_allow_list_global_has_a_torch_free_stand_in():
    """Nothing the shared list admits is imported by the consolidator: each resolves to a stand-in here."""
    import io

    from fsdp_workflow.core import safe_pickle
    from fsdp_workflow.consolidate.metadata import RestrictedUnpickler

    unpickler = RestrictedUnpickler(io.BytesIO(b""), "test")
    names = set(safe_pickle.DCP_METADATA_GLOBALS) | set(safe_pickle.TENSOR_ARCHIVE_GLOBALS)
    names |= {("torch", n) for n in safe_pickle.TORCH_DTYPE_NAMES}
    for module, name in sorted(names):
        obj = unpickler.find_class(module, name)
        home = getattr(obj, "__module__", None) or type(obj).__module__
        assert not home.startswith("torch"), (module, name, obj)


def test_plan_output_drops_the_tied_head_and_splits_files(tmp_path):
    """plan_output alone: key mapping, tied lm_head dropped, cast of floats only, one file per size limit."""
    from fsdp_workflow.consolidate.reader import DcpCheckpoint
    from fsdp_workflow.consolidate.source import Reference, Source
    from fsdp_workflow.consolidate.steps import plan_output
    from fsdp_workflow.consolidate.synthetic import write_dcp

    specs = [("model.model.embed_tokens.weight", (8, 4), torch.float32), ("model.lm_head.weight", (8, 4), torch.float32),
             ("model.model.norm.weight", (4,), torch.float32), ("model.model.steps", (2,), torch.int64),
             ("optimizer.state.x", (3,), torch.float32)]
    write_dcp(tmp_path / "ckpt", specs, lambda fqn, o, s, dt: torch.zeros(s, dtype=dt), dp=2)
    config = {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    source = Source("dcp", [tmp_path / "ckpt"], [DcpCheckpoint(tmp_path / "ckpt")], None,
                    Reference(tmp_path, config, ["LlamaForCausalLM"]))
    plan = plan_output(source, out_dtype="bfloat16", weights=None, max_shard_bytes=64)
    assert [t.name for t in plan.tensors] == ["model.embed_tokens.weight", "model.norm.weight", "model.steps"]
    assert plan.tied is not None and (plan.tied.dropped, plan.tied.kept) == ("lm_head.weight", "model.embed_tokens.weight")
    assert [t.dtype for t in plan.tensors] == ["bfloat16", "bfloat16", "int64"]
    assert plan.total_bytes == 8 * 4 * 2 + 4 * 2 + 2 * 8 and plan.dtype == "bfloat16"
    assert [f.name for f in plan.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
