"""What the config says is what runs: every bad value refused by the real CLI, exit 2, key named.

Each case runs ``python -m fsdp_workflow <overrides> dry_run=true run_dir=DIR`` (plus
``+experiment=smoke`` unless it names an experiment) and must exit 2 with the key in
stderr, no traceback, and no run directory written. The valid variations must plan.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from typing import List, Tuple

import forked_cli  # tests/forked_cli.py
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SLURM = ["cluster=slurm", "cluster.partition=debug"]
CUDA = "cluster.device=cuda"

# (overrides, key the message must name)
NEW_INVALID: List[Tuple[List[str], str]] = [
    # unknown keys, with and without +, and keys that were removed because nothing read them
    (["+train.max_stepz=3"], "train.max_steps"),
    (["train.max_stepz=3"], "train.max_steps"),
    (["+model.foo=1"], "model.foo"),
    (["trian.max_steps=3"], "trian.max_steps"),
    (["train.seed.x=1"], "train.seed"),
    (["strategy.state_dict_type=FULL_STATE_DICT"], "strategy.state_dict_type"),
    (["strategy.zero3_save_16bit_model=false"], "strategy.zero3_save_16bit_model"),
    (["model.load_in_4bit=true"], "model.load_in_4bit"),
    # model shape
    (["model.hidden_size=4100", "model.num_attention_heads=32", "model.num_key_value_heads=8"], "model.hidden_size"),
    (["model.num_key_value_heads=3"], "model.num_key_value_heads"),
    (["model.hidden_size=36"], "model.num_attention_heads"),  # head dim 9: RoPE needs it even
    (["model.num_attention_heads=0"], "model.num_attention_heads"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["model.max_position_embeddings=0"], "model.max_position_embeddings"),
    (["model.rope_theta=0"], "model.rope_theta"),
    # cluster numbers
    (["cluster.cpus_per_task=0"], "cluster.cpus_per_task"),
    (["cluster.rdzv_timeout_s=0"], "cluster.rdzv_timeout_s"),
    (["cluster.gpu_mem_gb=0"], "cluster.gpu_mem_gb"),
    (["cluster.consolidate_mem_gb=0"], "cluster.consolidate_mem_gb"),
    (["cluster.consolidate_cpus=0"], "cluster.consolidate_cpus"),
    (["cluster.nodes=0"], "cluster.nodes"),
    (["cluster.processes_per_node=0"], "cluster.processes_per_node"),
    ([*SLURM, "cluster.time_min=0"], "cluster.time_min"),
    (["cluster.master_port_base=80"], "cluster.master_port_base"),
    (["cluster.port_range=0"], "cluster.port_range"),
    (["cluster.signal_delay_s=-1"], "cluster.signal_delay_s"),
    (["cluster.max_requeues=-1"], "cluster.max_requeues"),
    # train / checkpoint / optimizer / data numbers
    (["train.eval_batches=-1"], "train.eval_batches"),
    (["train.grad_accum_steps=0"], "train.grad_accum_steps"),
    (["train.log_every_steps=0"], "train.log_every_steps"),
    (["train.eval_every_steps=-5"], "train.eval_every_steps"),
    (["train.seed=-1"], "train.seed"),
    (["train.peak_tflops=0"], "train.peak_tflops"),
    (["checkpoint.every_steps=-1"], "checkpoint.every_steps"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
    (["optimizer.eps=0"], "optimizer.eps"),
    (["optimizer.min_lr_ratio=1.5"], "optimizer.min_lr_ratio"),
    (["optimizer.scheduler=constant", "optimizer.min_lr_ratio=0.1"], "optimizer.min_lr_ratio"),  # would be ignored
    (["data.seed=-1"], "data.seed"),
    # consolidation
    (["consolidate.max_shard_size=0"], "consolidate.max_shard_size"),
    (["consolidate.max_shard_size=5XB"], "consolidate.max_shard_size"),
    (["consolidate.output_dir=${run_dir}/checkpoints"], "consolidate.output_dir"),
    (["consolidate.output_dir=${run_dir}"], "consolidate.output_dir"),
    # ring context parallelism cannot keep packed documents apart: refused, not ignored (ulysses is built)
    (["strategy.context_parallel_size=2", "strategy.context_parallel_impl=ring"], "strategy.context_parallel_impl"),
    # a tensor-parallel size that does not divide the world (2 processes)
    (["strategy.tensor_parallel_size=3"], "strategy.tensor_parallel_size"),
    # launchers that cannot honour the run
    (["cluster.launcher=accelerate"], "cluster.launcher"),  # on CPU
    # #SBATCH tokens, checked with everything else instead of while rendering
    ([*SLURM[:1], "cluster.partition='gpu a'"], "cluster.partition"),
    (["name='my run'"], "name"),
    ([*SLURM, "cluster.account='a;b'"], "cluster.account"),
    # evaluation job sized against the model (bf16 load of an 8B model in 8 GB)
    (["+experiment=llama8b_fft", "cluster.partition=gpu", "consolidate.every_checkpoint=true"],
     "cluster.consolidate_mem_gb"),
    (["strategy=deepspeed_zero3", CUDA, "strategy.zero_stage=4"], "strategy.zero_stage"),
    (["experiment=no_such_experiment"], "experiment"),
]

VALID: List[List[str]] = [
    [],  # the bare command: the smoke run
    ["+experiment=smoke", "consolidate.max_shard_size=1TB"],
    ["+experiment=smoke", "consolidate.max_shard_size=2GiB"],
    ["+experiment=smoke", "optimizer.scheduler=linear", "optimizer.min_lr_ratio=0.1"],
    ["+experiment=smoke", "+cluster.nccl_env.NCCL_DEBUG=INFO"],
    ["+experiment=smoke", "+model.extra_config.rms_norm_eps=1e-5"],
    ["+experiment=smoke", "model=tiny_qwen2"],
    ["+experiment=smoke", "strategy=ddp"],
    ["+experiment=smoke", *SLURM],
    ["+experiment=smoke", "consolidate.output_dir=${run_dir}/../elsewhere_model"],
    ["+experiment=llama8b_fft", "cluster.partition=gpu", "cluster.account=proj-1"],
    ["+experiment=llama8b_fft", "cluster.partition=gpu", "consolidate.every_checkpoint=true",
     "cluster.consolidate_mem_gb=24"],
    ["experiment=null"],
    ["~experiment"],
    ["+experiment=smoke", "strategy.tensor_parallel_size=2"],  # dp_shard 1 x tp 2 on the 2 processes
]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return forked_cli.run(args, cwd=cwd, env=env, timeout=120)  # `python -m fsdp_workflow ARGS`, forked


def _with_smoke(overrides: List[str]) -> List[str]:
    names_experiment = any(o.lstrip("+~").startswith("experiment") for o in overrides)
    return overrides if names_experiment else ["+experiment=smoke", *overrides]


def test_the_new_corpus_is_large_and_distinct() -> None:
    assert len(NEW_INVALID) >= 40
    assert len({" ".join(o) for o, _ in NEW_INVALID}) == len(NEW_INVALID)
    assert len(VALID) >= 10


@pytest.mark.parametrize("overrides,key", NEW_INVALID, ids=[" ".join(o) for o, _ in NEW_INVALID])
def test_invalid_config_exits_2_names_the_key_and_writes_nothing(tmp_path: Path, overrides, key) -> None:
    run_dir = tmp_path / "run"
    res = cli(*_with_smoke(overrides), "dry_run=true", f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert key in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert not run_dir.exists(), f"{run_dir} was written for an invalid config"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "something was written beside the run dir"


@pytest.mark.parametrize("overrides", VALID, ids=[" ".join(o) or "bare" for o in VALID])
def test_valid_variation_plans(tmp_path: Path, overrides) -> None:
    run_dir = tmp_path / "run"
    extra = ["data.path=/data/sft.jsonl"] if any("llama8b" in o for o in overrides) else []
    res = cli(*overrides, *extra, "dry_run=true", f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.sbatch").is_file()


def _planned(tmp_path: Path, *overrides: str) -> dict:
    run_dir = tmp_path / "run"
    res = cli(*overrides, "dry_run=true", f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_smoke_values_do_not_leak_into_a_hand_composed_run(tmp_path: Path) -> None:
    cfg = _planned(tmp_path, "model=llama3_8b", "cluster=slurm", "cluster.partition=gpu")
    assert cfg["name"] != "smoke"
    assert cfg["cluster"]["device"] == "cuda" and cfg["train"]["max_steps"] != 30 and cfg["train"]["seq_len"] != 128


def test_the_bare_command_is_still_the_smoke_run(tmp_path: Path) -> None:
    cfg = _planned(tmp_path)
    assert cfg["name"] == "smoke" and cfg["train"]["max_steps"] == 30


@pytest.mark.parametrize("spelling", ["experiment=null", "~experiment"])
def test_no_experiment_gives_the_base_defaults(tmp_path: Path, spelling: str) -> None:
    cfg = _planned(tmp_path, spelling)
    assert cfg["name"] == "run" and cfg["train"]["max_steps"] == 1000


def test_cfg_job_works_with_run_dir_and_no_overrides(tmp_path: Path) -> None:
    res = cli(f"run_dir={tmp_path / 'r'}", "--cfg", "job", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "name: smoke" in res.stdout


def test_unknown_key_suggests_the_closest_valid_one(tmp_path: Path) -> None:
    res = cli("+train.max_stepz=3", cwd=tmp_path)
    assert res.returncode == 2 and "did you mean train.max_steps?" in res.stderr, res.stderr


def test_missing_optional_package_is_an_error_for_a_real_local_run(tmp_path: Path) -> None:
    assert importlib.util.find_spec("torchao") is None, "this check needs torchao absent (it is not a dependency)"
    run_dir = tmp_path / "run"
    res = cli("+experiment=smoke", "optimizer=adamw_torch_8bit", f"run_dir={run_dir}", cwd=tmp_path)
    assert res.returncode == 2 and "torchao" in res.stderr and "optimizer.name" in res.stderr, res.stderr
    assert not run_dir.exists()
    # ... and only a warning for a Slurm run, where the job's environment decides
    res = cli("+experiment=smoke", "optimizer=adamw_torch_8bit", *SLURM, "dry_run=true", f"run_dir={run_dir}",
              cwd=tmp_path)
    assert res.returncode == 0 and "warning" in res.stderr and "torchao" in res.stderr, res.stderr
