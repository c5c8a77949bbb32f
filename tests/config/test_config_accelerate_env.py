"""accelerate_env: Accelerate's REAL plugins, built from the environment we write, match the config.

Every strategy option is swept; each config is first checked by ``validate`` so
only configs the planner would accept are exercised.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
from typing import Dict

import pytest

from fsdp_workflow.config.accelerate_env import accelerate_env, read_launch_env
from fsdp_workflow.plan.render import render_launch_env


def write_launch_env(env, path):
    """launch.env as the planner writes it (plan.render), for the round trips below."""
    path.write_text(render_launch_env(env))
    return path
from fsdp_workflow.config.load import compose
from fsdp_workflow.config.schema import (
    ActivationCheckpointing,
    AutoWrapPolicy,
    BackwardPrefetch,
    MixedPrecision,
    OffloadDevice,
    ShardingStrategy,
    StrategyName,
    WorkflowConfig,
)
from fsdp_workflow.config.validate import validate

torch = pytest.importorskip("torch")
accelerate_utils = pytest.importorskip("accelerate.utils")

_BASE: Dict[str, WorkflowConfig] = {}


def base(strategy: str) -> WorkflowConfig:
    """A valid GPU config for ``strategy`` (composed once), with consolidation off to allow every state dict."""
    if strategy not in _BASE:
        _BASE[strategy] = compose([f"strategy={strategy}", "cluster.device=cuda", "consolidate.enabled=false",
                                  "dry_run=true"])  # planning only: deepspeed need not be installed here
    return copy.deepcopy(_BASE[strategy])


def plugin_env(monkeypatch, cfg: WorkflowConfig) -> Dict[str, str]:
    report = validate(cfg)
    assert report.errors == [], "\n".join(i.format() for i in report.errors)
    env = accelerate_env(cfg)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def fake_gpu(monkeypatch):
    """FSDP1 + sync_module_states asks for the current GPU; pretend there is one.

    Through torch's public device queries only, which every Accelerate release asks in the end
    (1.15 through its ``is_cuda_available``, 1.16 through ``torch.accelerator``): a test that
    patched Accelerate's own helpers broke when 1.16 removed one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))


def check_fsdp(cfg: WorkflowConfig, env: Dict[str, str], mp: str = "no") -> None:
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy as TorchSharding
    from torch.distributed.fsdp import StateDictType as TorchSDT
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    s = cfg.strategy
    p = accelerate_utils.FullyShardedDataParallelPlugin()
    version = 2 if s.name == StrategyName.fsdp2 else 1
    assert p.fsdp_version == version
    assert p.state_dict_type == TorchSDT.SHARDED_STATE_DICT  # what the trainer's DCP checkpoints are
    wrap = {
        AutoWrapPolicy.TRANSFORMER_BASED_WRAP: transformer_auto_wrap_policy,
        AutoWrapPolicy.SIZE_BASED_WRAP: size_based_auto_wrap_policy,
        AutoWrapPolicy.NO_WRAP: None,
    }[s.auto_wrap_policy]
    assert p.auto_wrap_policy is wrap
    if s.auto_wrap_policy == AutoWrapPolicy.TRANSFORMER_BASED_WRAP:
        assert p.transformer_cls_names_to_wrap == [cfg.model.decoder_layer_cls]
    if s.auto_wrap_policy == AutoWrapPolicy.SIZE_BASED_WRAP:
        assert p.min_num_params == s.min_num_params
    # Accelerate checkpoints every layer or none: the selective modes are the trainer's own (false here).
    assert p.activation_checkpointing is (s.activation_checkpointing == ActivationCheckpointing.full)
    assert p.cpu_ram_efficient_loading is s.cpu_ram_efficient_loading
    if version == 2:
        from torch.distributed.fsdp import CPUOffloadPolicy

        assert p.reshard_after_forward is s.reshard_after_forward
        assert isinstance(p.cpu_offload, CPUOffloadPolicy) is s.offload_params
        assert p.use_orig_params is None and p.sync_module_states is None and p.backward_prefetch is None
    else:
        # Accelerate maps names by position (HYBRID_SHARD_ZERO2 is torch's private _HYBRID_SHARD_ZERO2)
        assert p.sharding_strategy == TorchSharding(list(ShardingStrategy).index(s.sharding_strategy) + 1)
        assert p.cpu_offload.offload_params is s.offload_params
        assert p.use_orig_params is s.use_orig_params
        assert p.sync_module_states is s.sync_module_states
        assert p.forward_prefetch is s.forward_prefetch
        expected = None if s.backward_prefetch == BackwardPrefetch.NO_PREFETCH else TorchPrefetch[s.backward_prefetch.value]
        assert p.backward_prefetch == expected
    if mp != "no":  # what AcceleratorState does with ACCELERATE_MIXED_PRECISION
        p.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
        assert p.mixed_precision_policy.param_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[mp]


FSDP2_GRID = list(itertools.product(
    list(AutoWrapPolicy),
    [False, True],  # offload_params
    list(ActivationCheckpointing),
    [True, False],  # reshard_after_forward
))


@pytest.mark.parametrize("wrap,offload,ac,reshard", FSDP2_GRID, ids=lambda v: str(getattr(v, "value", v)))
def test_fsdp2_plugin_matches_config(clean_accelerate_env, wrap, offload, ac, reshard):
    cfg = base("fsdp2")
    s = cfg.strategy
    s.auto_wrap_policy, s.offload_params = wrap, offload
    s.activation_checkpointing, s.reshard_after_forward = ac, reshard
    s.min_num_params = 1_000_000 if wrap == AutoWrapPolicy.SIZE_BASED_WRAP else None
    env = plugin_env(clean_accelerate_env, cfg)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_USE_DEEPSPEED"] == "false"
    check_fsdp(cfg, env)


FSDP1_GRID = list(itertools.product(
    list(AutoWrapPolicy),
    list(ShardingStrategy),
    [False, True],  # offload_params
    [ActivationCheckpointing.none, ActivationCheckpointing.full],  # FSDP1 has no selective modes
))


@pytest.mark.parametrize("wrap,sharding,offload,ac", FSDP1_GRID, ids=lambda v: str(getattr(v, "value", v)))
def test_fsdp1_plugin_matches_config(clean_accelerate_env, wrap, sharding, offload, ac):
    fake_gpu(clean_accelerate_env)
    cfg = base("fsdp1")
    s = cfg.strategy
    s.auto_wrap_policy, s.sharding_strategy = wrap, sharding
    s.offload_params, s.activation_checkpointing = offload, ac
    s.min_num_params = 1_000_000 if wrap == AutoWrapPolicy.SIZE_BASED_WRAP else None
    env = plugin_env(clean_accelerate_env, cfg)
    check_fsdp(cfg, env)


@pytest.mark.parametrize(
    "prefetch,forward,orig,sync,ram",
    [
        combo
        for combo in itertools.product(list(BackwardPrefetch), [False, True], [False, True], [False, True], [False, True])
        if combo[3] or not combo[4]  # validate rejects RAM-efficient loading without sync_module_states
    ],
    ids=lambda v: str(getattr(v, "value", v)),
)
def test_fsdp1_prefetch_and_loading_knobs(clean_accelerate_env, prefetch, forward, orig, sync, ram):
    fake_gpu(clean_accelerate_env)
    cfg = base("fsdp1")
    s = cfg.strategy
    s.backward_prefetch, s.forward_prefetch, s.use_orig_params = prefetch, forward, orig
    s.sync_module_states, s.cpu_ram_efficient_loading = sync, ram
    check_fsdp(cfg, plugin_env(clean_accelerate_env, cfg))


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("mp", ["no", "bf16", "fp16"])
def test_fsdp_mixed_precision(clean_accelerate_env, strategy, mp):
    if strategy == "fsdp1":
        fake_gpu(clean_accelerate_env)
    cfg = base(strategy)
    cfg.train.mixed_precision = MixedPrecision(mp)
    env = plugin_env(clean_accelerate_env, cfg)
    assert env["ACCELERATE_MIXED_PRECISION"] == mp
    check_fsdp(cfg, env, mp)


@pytest.mark.parametrize("rep,tp", [(1, 2), (2, 1), (2, 2), (8, 1)])
def test_mesh_is_exported_in_parallelism_config_names(clean_accelerate_env, rep, tp):
    """The mesh in ParallelismConfig's variables; Accelerate's own class parses them to the same sizes,
    and the trainer's MeshDims, built from the typed config, has the same sizes. ACCELERATE_USE_PARALLELISM_CONFIG stays unset (see
    the fsdp2 spec's _mesh_env (config/strategies/fsdp2.py): Accelerate refuses it on CPU and its FSDP2 + TP path needs a class
    transformers 5 removed), so Accelerator() builds no ParallelismConfig of its own."""
    from accelerate.parallelism_config import ParallelismConfig

    from fsdp_workflow.config.schema import mesh_shape
    from fsdp_workflow.train.mesh import MeshDims

    cfg = base("fsdp2")
    cfg.cluster.processes_per_node = 8
    cfg.strategy.dp_replicate_size, cfg.strategy.tensor_parallel_size = rep, tp
    env = plugin_env(clean_accelerate_env, cfg)
    shape = mesh_shape(cfg)
    assert shape == {"dp_replicate": rep, "dp_shard": 8 // (rep * tp), "cp": 1, "tp": tp}
    assert {k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")} == {
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(rep), "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(8 // (rep * tp)),
        "PARALLELISM_CONFIG_TP_SIZE": str(tp)}
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in env
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.cp_size, pc.tp_size) == tuple(shape.values())
    assert MeshDims.of(cfg, 8).shape == tuple(shape.values())


def test_plain_fsdp2_writes_no_mesh(clean_accelerate_env):
    env = plugin_env(clean_accelerate_env, base("fsdp2"))
    assert not any(k.startswith("PARALLELISM_CONFIG") for k in env)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_ring_context_parallel_is_refused_with_the_reason(device):
    cfg = base("fsdp2")
    cfg.cluster.device = cfg.cluster.device.__class__(device)
    cfg.cluster.processes_per_node = 4
    cfg.strategy.context_parallel_size = 2
    assert validate(cfg).errors == []  # ulysses, the default, is built
    cfg.strategy.context_parallel_impl = cfg.strategy.context_parallel_impl.__class__("ring")
    errors = [i for i in validate(cfg).errors if i.key == "strategy.context_parallel_impl"]
    assert len(errors) == 1, validate(cfg).errors
    expected = "cannot run on CPU" if device == "cpu" else "not implemented"
    assert expected in errors[0].why and "strategy.context_parallel_impl=ulysses" in errors[0].fix
    assert not any(k.startswith("PARALLELISM_CONFIG") for k in accelerate_env(cfg))


DS_GRID = [
    (stage, opt, param, mp)
    for stage in (1, 2, 3)
    for opt in list(OffloadDevice)
    for param in list(OffloadDevice)
    for mp in ("no", "bf16", "fp16")
    if param == OffloadDevice.none or stage == 3
]


@pytest.mark.parametrize("stage,opt,param,mp", DS_GRID, ids=lambda v: str(getattr(v, "value", v)))
def test_deepspeed_plugin_matches_config(clean_accelerate_env, tmp_path, stage, opt, param, mp):
    cfg = base(f"deepspeed_zero{stage}")
    s = cfg.strategy
    s.offload_optimizer_device, s.offload_param_device = opt, param
    if OffloadDevice.nvme in (opt, param):
        s.offload_nvme_path = str(tmp_path / "nvme dir")
    cfg.train.mixed_precision = MixedPrecision(mp)
    cfg.train.grad_accum_steps = 4
    env = plugin_env(clean_accelerate_env, cfg)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_USE_FSDP"] == "false"

    p = accelerate_utils.DeepSpeedPlugin()
    assert p.zero_stage == stage
    assert p.offload_optimizer_device == opt.value
    assert p.offload_param_device == param.value
    assert p.gradient_accumulation_steps == 4
    assert p.gradient_clipping == cfg.optimizer.max_grad_norm
    assert p.zero3_init_flag is (stage == 3 and s.zero3_init_flag)
    zero = p.deepspeed_config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero["offload_optimizer"]["device"] == opt.value
    assert zero["offload_param"]["device"] == param.value
    if opt == OffloadDevice.nvme:
        assert zero["offload_optimizer"]["nvme_path"] == s.offload_nvme_path
    if param == OffloadDevice.nvme:
        assert zero["offload_param"]["nvme_path"] == s.offload_nvme_path
    assert p.deepspeed_config["gradient_accumulation_steps"] == 4
    assert p.deepspeed_config["gradient_clipping"] == cfg.optimizer.max_grad_norm
    p.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    assert p.deepspeed_config.get("bf16", {}).get("enabled", False) is (mp == "bf16")
    assert p.deepspeed_config.get("fp16", {}).get("enabled", False) is (mp == "fp16")


@pytest.mark.parametrize("init", [True, False])
def test_deepspeed_zero3_flags(clean_accelerate_env, init):
    cfg = base("deepspeed_zero3")
    cfg.strategy.zero3_init_flag = init
    cfg.optimizer.max_grad_norm = None
    plugin_env(clean_accelerate_env, cfg)
    p = accelerate_utils.DeepSpeedPlugin()
    assert p.zero3_init_flag is init
    # null disables clipping: DeepSpeed clips at gradient_clipping > 0 only (Accelerate 1.16 writes 0.0, 1.15 nothing)
    assert not p.gradient_clipping and not p.deepspeed_config.get("gradient_clipping")


def test_ddp_env_enables_neither_fsdp_nor_deepspeed(composed):
    env = accelerate_env(composed(["strategy=ddp"]))
    assert env["ACCELERATE_USE_FSDP"] == env["ACCELERATE_USE_DEEPSPEED"] == "false"
    assert not [k for k in env if k.startswith(("FSDP_", "ACCELERATE_DEEPSPEED_"))]


def test_fsdp2_env_holds_only_what_fsdp2_reads(composed):
    env = accelerate_env(composed([]))
    for fsdp1_only in ("FSDP_SHARDING_STRATEGY", "FSDP_BACKWARD_PREFETCH", "FSDP_FORWARD_PREFETCH",
                       "FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES"):
        assert fsdp1_only not in env
    assert env["ACCELERATE_USE_CPU"] == "true"  # the smoke run is on CPU


@pytest.mark.parametrize("name", ["smoke", "llama8b_fft", "llama8b_zero3", "qwen7b_fft", "mistral7b_fft"])
def test_experiment_env_round_trips_through_launch_env(composed, tmp_path, name):
    extra = [] if name == "smoke" else ["cluster.partition=gpu", "data.path=/data/sft.jsonl"]
    env = accelerate_env(composed([f"+experiment={name}", *extra]))
    path = write_launch_env(env, tmp_path / "launch.env")
    assert read_launch_env(path) == env


def test_launch_env_is_safe_for_bash_and_python(weird_dir):
    env = {"PLAIN": "x", "WEIRD": weird_dir.name, "PATHY": str(weird_dir), "EMPTY": "", "DOLLAR": "$HOME `id` $(id)"}
    path = write_launch_env(env, weird_dir / "launch.env")
    assert read_launch_env(path) == env
    dump = "import os, json; print(json.dumps({k: os.environ[k] for k in %r}))" % sorted(env)
    for loader in ('source "$1"', 'set -a; . "$1"; set +a'):
        out = subprocess.run(
            ["bash", "-c", f'{loader}; exec python3 -c "$2"', "bash", str(path), dump],
            check=True, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": "/nowhere"},
        ).stdout
        import json

        assert json.loads(out) == env


@pytest.mark.parametrize("bad", [{"1BAD": "x"}, {"A-B": "x"}, {"NUL": "a\0b"}])
def test_write_launch_env_rejects_what_no_environment_can_hold(tmp_path, bad):
    with pytest.raises(ValueError):
        write_launch_env(bad, tmp_path / "launch.env")
