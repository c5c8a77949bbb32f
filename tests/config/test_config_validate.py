"""Validation: shipped configs pass, the invalid corpus fails naming the key, messages carry the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from invalid_corpus import INVALID_CASES, case_id

from fsdp_workflow.config.errors import ConfigError, Issue
from fsdp_workflow.config.load import CONF_DIR
from fsdp_workflow.plan.checks import check as validate  # config, container and data rules, as the CLI runs them

SLURM_EXPERIMENT = ["cluster.partition=gpu", "data.path=/data/sft.jsonl"]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
GROUPS = ["model", "data", "strategy", "optimizer", "cluster", "container"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


def option_overrides(group: str, option: str, tmp_path: Path) -> list:
    """What an option needs on top of the smoke default to be a valid run."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    image = tmp_path / "fsdp_workflow.sif"
    image.write_text("")
    needs = {
        ("model", "llama3_8b"): ["dry_run=true"],  # weights live on the cluster
        ("model", "mistral_7b"): ["dry_run=true"],
        ("model", "qwen2_5_7b"): ["dry_run=true"],
        ("data", "jsonl"): [f"data.path={data}"],
        ("data", "chat_jsonl"): [f"data.path={data}", "data.chat_template=chatml"],  # the tiny model's tokenizer has none
        ("data", "mixture"): [f"data.sources=[{{path: {data}, weight: 1}}]", "data.format=text"],
        ("strategy", "fsdp1"): ["cluster.device=cuda"],  # Accelerate's FSDP1 sync needs a GPU
        # optional packages (deepspeed, bitsandbytes, torchao) are errors only for a real local run
        ("strategy", "deepspeed_zero1"): ["cluster.device=cuda", "dry_run=true"],
        ("strategy", "deepspeed_zero2"): ["cluster.device=cuda", "dry_run=true"],
        ("strategy", "deepspeed_zero3"): ["cluster.device=cuda", "dry_run=true"],
        ("optimizer", "adamw_8bit"): ["strategy=ddp", "dry_run=true"],  # bitsandbytes can't step FSDP2 DTensors
        ("optimizer", "adamw_torch_8bit"): ["dry_run=true"],
        ("cluster", "slurm"): ["cluster.partition=debug"],
        ("container", "apptainer"): [f"container.image={image}"],
        ("container", "pyxis"): ["cluster=slurm", "cluster.partition=debug", "container.image=nvcr.io/nvidia/pytorch:25.01-py3"],
        # an image directory; dry run: the run directory's bind destination is checked in the image (a warning then)
        ("container", "charliecloud"): [f"container.image={tmp_path}", "dry_run=true"],
    }
    return [f"{group}={option}", *needs.get((group, option), [])]


def test_default_config_is_valid_without_warnings(composed):
    report = validate(composed([]))
    assert report.errors == [] and report.warnings == []


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_validates(composed, name):
    extra = [] if name.startswith("smoke") else SLURM_EXPERIMENT  # the smoke runs run here
    report = validate(composed([f"+experiment={name}", *extra]))
    assert report.errors == [], "\n".join(i.format() for i in report.errors)


def test_shipped_experiments_are_all_covered():
    assert {"smoke", "llama8b_fft", "llama8b_zero3", "qwen7b_fft", "mistral7b_fft"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_validates(composed, tmp_path, group, option):
    report = validate(composed(option_overrides(group, option, tmp_path)))
    assert report.errors == [], "\n".join(i.format() for i in report.errors)


def test_corpus_is_large_enough():
    assert len(INVALID_CASES) >= 25
    assert len({case_id(c) for c in INVALID_CASES}) == len(INVALID_CASES)


@pytest.mark.parametrize("case", INVALID_CASES, ids=case_id)
def test_invalid_config_names_the_key(composed, case):
    overrides, key = case
    report = validate(composed([*overrides, "dry_run=true"]))  # as the CLI corpus runs it
    assert key in report.keys(), f"expected an error on {key}; got {report.keys()}"
    with pytest.raises(ConfigError) as info:
        report.raise_if_errors()
    message = str(info.value)
    assert message.startswith(f"found {len(report.errors)} problem")
    assert key in message and "why:" in message and "fix:" in message


def test_every_error_is_collected_not_just_the_first(composed):
    report = validate(composed(["optimizer=adamw_8bit", "train.seq_len=4096", "checkpoint.keep_last=-1", "cluster.nodes=2"]))
    assert {"optimizer.name", "train.seq_len", "checkpoint.keep_last", "cluster.nodes"} <= set(report.keys())
    with pytest.raises(ConfigError) as info:
        report.raise_if_errors()
    assert str(info.value).startswith(f"found {len(report.errors)} problems in the config:")
    assert len(info.value.issues) == len(report.errors)
    assert isinstance(info.value, ValueError)


def test_issue_format_names_key_value_why_and_fix():
    text = Issue("optimizer.name", "adamw_8bit", "bnb cannot step DTensors", "optimizer=adamw_torch_8bit").format()
    assert text.splitlines()[0] == "optimizer.name = 'adamw_8bit'"
    assert "why: bnb cannot step DTensors" in text and "fix: optimizer=adamw_torch_8bit" in text


def test_fsdp2_8bit_error_suggests_torch_8bit(composed):
    (issue,) = [i for i in validate(composed(["optimizer=adamw_8bit", "dry_run=true"])).errors
                if i.key == "optimizer.name"]
    assert "optimizer=adamw_torch_8bit" in issue.fix


def test_global_batch_fix_gives_the_accumulation_to_type(composed):
    # 2 ranks x micro 2 = 4 per accumulation step; 16 needs grad_accum_steps=4
    (issue,) = [i for i in validate(composed(["train.global_batch_size=16"])).errors]
    assert issue.key == "train.global_batch_size" and "train.grad_accum_steps=4" in issue.fix


def test_tensor_parallel_ranks_are_not_counted_in_the_batch(composed):
    # 2 ranks, tp 2: one data-parallel rank, so micro 2 x accum 1 x dp 1 = 2 sequences per step.
    assert validate(composed(["strategy.tensor_parallel_size=2", "train.global_batch_size=2"])).errors == []
    (issue,) = validate(composed(["strategy.tensor_parallel_size=2", "train.global_batch_size=4"])).errors
    assert issue.key == "train.global_batch_size" and "data-parallel size 1" in issue.why


def test_mesh_rules(composed):
    """TP within a node (an error, not a warning), hybrid sharding needs FSDP2, replicas that straddle nodes warn."""
    slurm = ["cluster=slurm", "cluster.partition=debug"]
    across = validate(composed([*slurm, "cluster.nodes=2", "cluster.processes_per_node=1",
                                "strategy.tensor_parallel_size=2"]))
    assert [i.key for i in across.errors] == ["strategy.tensor_parallel_size"]
    assert "span nodes" in across.errors[0].why
    odd = validate(composed([*slurm, "cluster.nodes=3", "cluster.processes_per_node=2", "strategy.dp_replicate_size=2"]))
    assert odd.errors == [] and [w.key for w in odd.warnings] == ["strategy.dp_replicate_size"]
    hybrid = validate(composed([*slurm, "cluster.nodes=2", "cluster.processes_per_node=4",
                                "strategy.dp_replicate_size=2", "strategy.tensor_parallel_size=2"]))
    assert hybrid.errors == [] and hybrid.warnings == []
    seq = validate(composed(["cluster.processes_per_node=4", "strategy.context_parallel_size=3", "train.seq_len=64"]))
    assert {"strategy.context_parallel_size", "train.seq_len"} <= set(seq.keys())  # 3 divides neither 4 ranks nor 64


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["strategy=fsdp1", "cluster.device=cuda"], "strategy.name"),  # deprecation
        (["cluster.processes_per_node=1"], "cluster.processes_per_node"),  # FSDP at world size 1 under torchrun
        (["cluster.device=cuda", "train.mixed_precision=fp16"], "train.mixed_precision"),  # fp16 + FSDP2
        (["strategy.auto_wrap_policy=NO_WRAP"], "strategy.auto_wrap_policy"),
        (["strategy=ddp", "strategy.reshard_after_forward=false"], "strategy.reshard_after_forward"),
        (["strategy.backward_prefetch=BACKWARD_POST"], "strategy.backward_prefetch"),
        (["cluster.device=cuda", "cluster.gpus_per_node=4"], "cluster.processes_per_node"),
        (["container.image=foo.sif"], "container.image"),
        (["consolidate.every_checkpoint=true"], "consolidate.every_checkpoint"),
    ],
)
def test_warnings_do_not_stop_the_run(composed, overrides, key):
    report = validate(composed(overrides))
    assert report.errors == [], "\n".join(i.format() for i in report.errors)
    assert key in [w.key for w in report.warnings]
    report.raise_if_errors()  # warnings never raise


@pytest.mark.parametrize(
    "overrides",
    [
        ["data=jsonl", "data.path=/nonexistent/fw/train.jsonl"],
        ["data.eval_path=/nonexistent/fw/eval.txt"],
        ["model.tokenizer=/nonexistent/fw/tok"],
        ["checkpoint.resume=/nonexistent/fw/checkpoints/step-10"],
        ["model=llama3_8b", "model.name_or_path=/nonexistent/fw/llama"],
    ],
)
def test_missing_path_is_an_error_locally_and_a_warning_otherwise(composed, overrides):
    key = overrides[-1].split("=")[0]
    assert key in validate(composed(overrides)).keys()  # local, real run
    for extra in (["dry_run=true"], ["cluster=slurm", "cluster.partition=debug"]):
        report = validate(composed([*overrides, *extra]))
        assert key not in report.keys() and key in [w.key for w in report.warnings]


def test_existing_paths_and_globs_pass(composed, tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    ok = ["data=jsonl", f"data.path={tmp_path}/*.jsonl", f"checkpoint.resume={tmp_path}"]
    assert validate(composed(ok)).errors == []


@pytest.mark.parametrize("size", ["5GB", "500MB", "2GiB", "1.5GB", "1000000", "10 GB"])
def test_shard_sizes_that_parse(composed, size):
    assert "consolidate.max_shard_size" not in validate(composed([f"consolidate.max_shard_size='{size}'"])).keys()


def test_validation_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys; import fsdp_workflow.config.validate, fsdp_workflow.config.accelerate_env;"
        "from fsdp_workflow.config.validate import validate;"
        "from fsdp_workflow.config.load import compose; validate(compose([]));"
        "bad = [m for m in ('torch', 'transformers', 'accelerate', 'deepspeed') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
