"""Configs that compose but must be rejected, each with the key the message must name.

Shared by the Python-API tests here (``test_config_validate.py``) and the CLI
tests, which run each case as::

    python -m fsdp_workflow <overrides...> dry_run=true run_dir=DIR   # expect exit 2, key in stderr

Every case stays an error under ``dry_run=true`` (nothing here depends on
files being present). Import it from another test directory with::

    spec = importlib.util.spec_from_file_location("invalid_corpus", ROOT / "tests/config/invalid_corpus.py")

The base is the smoke experiment (the config tests' ``composed`` fixture and the CLI
tests add ``+experiment=smoke``) (tiny Llama, FSDP2, local,
2 CPU processes, 30 steps, consolidation on).
"""

from __future__ import annotations

from typing import List, Tuple

CUDA = "cluster.device=cuda"

INVALID_CASES: List[Tuple[List[str], str]] = [
    # FSDP2 / FSDP1
    (["optimizer=adamw_8bit"], "optimizer.name"),
    (["optimizer.name=adamw_bnb_8bit"], "optimizer.name"),
    (["strategy=fsdp1", CUDA, "strategy.offload_params=true", "optimizer=adamw_8bit"], "strategy.offload_params"),
    (["strategy=fsdp1", CUDA, "strategy.sync_module_states=false"], "strategy.sync_module_states"),
    (["strategy=fsdp1"], "strategy.name"),  # FSDP1 on a CPU host: Accelerate and the trainer refuse it
    (["strategy=fsdp1", "strategy.sync_module_states=false", "strategy.cpu_ram_efficient_loading=false"],
     "strategy.name"),  # ... whatever its sync flags say (this once planned, then failed in the ranks)
    (["strategy.auto_wrap_policy=SIZE_BASED_WRAP"], "strategy.min_num_params"),
    (["strategy.activation_checkpointing=full", "model.gradient_checkpointing=true"], "model.gradient_checkpointing"),
    (["strategy.activation_checkpointing=ops", "model.gradient_checkpointing=true"], "model.gradient_checkpointing"),
    (["strategy.activation_checkpointing_every_n_layers=3"], "strategy.activation_checkpointing_every_n_layers"),
    (["strategy.activation_checkpointing=every_n_layers", "strategy.activation_checkpointing_every_n_layers=1"],
     "strategy.activation_checkpointing_every_n_layers"),  # 1 is `full`
    (["strategy.activation_checkpointing=every_n_layers", "strategy.activation_checkpointing_every_n_layers=9"],
     "strategy.activation_checkpointing_every_n_layers"),  # the tiny Llama has 2 layers: none would be checkpointed
    (["strategy=fsdp1", CUDA, "strategy.activation_checkpointing=ops"], "strategy.activation_checkpointing"),
    (["strategy=ddp", "strategy.activation_checkpointing=every_n_layers"], "strategy.activation_checkpointing"),
    (["strategy.forward_prefetch=true"], "strategy.forward_prefetch"),
    (["strategy.offload_optimizer_device=cpu"], "strategy.offload_optimizer_device"),
    # train.float8 (refused on CPU, under strategies and meshes it is not built for)
    (["train.float8=true"], "train.float8"),
    (["train.float8=true", CUDA, "strategy=deepspeed_zero2"], "train.float8"),
    (["train.float8=true", CUDA, "strategy.tensor_parallel_size=2"], "train.float8"),
    # DeepSpeed / DDP
    (["strategy=deepspeed_zero3", CUDA, "strategy.zero_stage=2"], "strategy.zero_stage"),
    (["strategy=deepspeed_zero2", CUDA, "strategy.activation_checkpointing=full"], "strategy.activation_checkpointing"),
    (["strategy=deepspeed_zero2", CUDA, "strategy.offload_param_device=cpu"], "strategy.offload_param_device"),
    (["strategy=deepspeed_zero3", CUDA, "strategy.offload_optimizer_device=nvme"], "strategy.offload_nvme_path"),
    (["strategy=deepspeed_zero2"], "strategy.name"),  # DeepSpeed on device=cpu
    (["strategy=ddp", "strategy.zero_stage=3"], "strategy.zero_stage"),
    (["strategy=ddp", "strategy.offload_params=true"], "strategy.offload_params"),
    # topology
    ([CUDA, "cluster.gpus_per_node=1"], "cluster.processes_per_node"),
    (["cluster.processes_per_node=1", "cluster.launcher=accelerate"], "cluster.launcher"),
    ([CUDA, "cluster.processes_per_node=2", "cluster.launcher=accelerate", "cluster.rank_start=preloaded"],
     "cluster.rank_start"),
    (["cluster.nodes=2"], "cluster.nodes"),
    (["cluster=slurm"], "cluster.partition"),
    (["cluster=slurm", "cluster.partition=debug", "cluster.time_min=5", "cluster.signal_delay_s=300"],
     "cluster.signal_delay_s"),
    (["strategy.tensor_parallel_size=3"], "strategy.tensor_parallel_size"),
    (["strategy.context_parallel_size=4"], "strategy.context_parallel_size"),
    (["strategy.tensor_parallel_size=2", "model.num_key_value_heads=1"], "strategy.tensor_parallel_size"),
    (["strategy=fsdp1", CUDA, "strategy.tensor_parallel_size=2"], "strategy.tensor_parallel_size"),
    (["strategy.dp_replicate_size=3"], "strategy.dp_replicate_size"),  # does not divide 2 ranks
    (["strategy=ddp", "strategy.dp_replicate_size=2"], "strategy.dp_replicate_size"),  # the mesh is FSDP2's
    (["cluster=slurm", "cluster.partition=debug", "cluster.nodes=2", "cluster.processes_per_node=1",
      "strategy.tensor_parallel_size=2"], "strategy.tensor_parallel_size"),  # TP across nodes
    (["cluster.processes_per_node=4", "strategy.dp_replicate_size=2", "strategy.tensor_parallel_size=2"],
     "strategy.dp_replicate_size"),  # replicas x TP with dp_shard 1
    (["train.mixed_precision=fp16"], "train.mixed_precision"),  # fp16 on CPU
    (["train.global_batch_size=7"], "train.global_batch_size"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.seq_len=4096"], "train.seq_len"),  # tiny_llama has 2048 positions
    (["cluster.master_port_base=65000"], "cluster.master_port_base"),
    # model / data / container
    (["model.init=pretrained"], "model.name_or_path"),
    (["data=jsonl"], "data.path"),
    # data format (the base's data is the shipped plain-text corpus)
    (["data=smoke_chat", "data.fallback_chat_template=null"], "data.chat_template"),  # byte-level tokenizer: none
    (["data=smoke_chat", "data.fallback_chat_template=vicuna"], "data.fallback_chat_template"),  # names nothing
    (["data=smoke_chat", "data.chat_template=vicuna"], "data.chat_template"),  # not shipped, not Jinja
    (["data.format=conversation"], "data.format"),  # plain text files have no fields
    (["data.chat_template=chatml"], "data.chat_template"),  # format=text applies no template
    (["data.train_on=last_assistant"], "data.train_on"),  # format=text trains every token
    (["data.allow_no_user=true"], "data.allow_no_user"),  # format=text has no turns: a dead knob
    (["data=smoke_chat", "+data.fields.turns=dialog"], "data.fields"),  # not a canonical field name
    (["data=smoke_chat", "data.text_field=body"], "data.text_field"),  # conversations read data.fields
    (["data=synthetic", "data.format=conversation"], "data.format"),
    (["data.num_workers=0"], "data.num_workers"),
    (["data.eval_fraction=1.5"], "data.eval_fraction"),
    (["container=apptainer"], "container.image"),
    (["container=pyxis", "container.image='nvcr.io#nvidia/pytorch:25.01-py3'"], "container.runtime"),
    # optimizer
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.warmup_steps=30"], "optimizer.warmup_steps"),
    (["optimizer.max_grad_norm=-1"], "optimizer.max_grad_norm"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas"),
    # checkpoint / consolidation
    (["checkpoint.every_steps=100"], "checkpoint.every_steps"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last"),
    (["checkpoint.every_steps=0", "checkpoint.save_final=false"], "checkpoint.save_final"),
    (["consolidate.max_shard_size=5gigs"], "consolidate.max_shard_size"),
    (["consolidate.remove_sharded=true", "consolidate.verify=false"], "consolidate.remove_sharded"),
    # issue 24: values that planned and failed later
    (["optimizer.lr=inf"], "optimizer.lr"),
    (["optimizer.eps=nan"], "optimizer.eps"),
    (["data.format=text", "data.text_field=''"], "data.text_field"),
    (["checkpoint.resume=maybe"], "checkpoint.resume"),
    (["model.attn_implementation=flash_attention_9"], "model.attn_implementation"),
    (["model.vocab_size=200"], "model.vocab_size"),  # the byte-level tokenizer has 260 ids
]


def case_id(case: Tuple[List[str], str]) -> str:
    """A readable pytest id: the overrides, joined."""
    return " ".join(case[0])
