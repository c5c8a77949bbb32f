"""Typed schema of every config group.

Values live in ``conf/*.yaml``; the shapes live here. Each YAML file links to
its schema through its defaults list, so Hydra rejects an unknown key or a
wrongly typed value at compose time and names the key. Choices are ``Enum``s
because OmegaConf 2.3 rejects ``Literal``. Units are in the field names
(``time_min``, ``mem_gb``, ``signal_delay_s``); counts start with ``num_``.

This module imports neither torch nor transformers: planning must answer in
about a second on a login node.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# The choices the strategy specs read live below this module; re-exported here under their old address.
from fsdp_workflow.config.choices import (  # noqa: F401
    ActivationCheckpointing, AutoWrapPolicy, Device, MixedPrecision, OffloadDevice,
)
from fsdp_workflow.config.strategies import strategy_names
from fsdp_workflow.core.rundir import RunDir


# --------------------------------------------------------------------------- bounds
BOUNDS_KEY = "fw_bounds"


@functools.lru_cache(maxsize=None)
def field_hints(cls: type) -> Dict[str, Any]:
    """``typing.get_type_hints`` of a schema dataclass, resolved once (the annotations are strings here).

    Every compose walks the schema several times (unknown keys, bounds, finite floats); resolving
    the same hints each time cost about a tenth of a second per compose. Read only: shared.
    """
    return typing.get_type_hints(cls)


def bounded(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None, lt: Optional[float] = None) -> Any:
    """A dataclass field whose numeric range is declared beside it.

    ``fsdp_workflow.config.rules_bounds`` checks every bounded field (``None``
    always passes: it means "not set"), and ``docs/configuration.md`` lists them.
    """
    return field(default=default, metadata={BOUNDS_KEY: {"ge": ge, "gt": gt, "le": le, "lt": lt}})


# --------------------------------------------------------------------------- enums
StrategyName = Enum(  # type: ignore[misc]  # members: the specs', in the registry's order
    "StrategyName", {name: name for name in strategy_names()}, type=str, module=__name__, qualname="StrategyName")
StrategyName.__doc__ = """How parameters, gradients and optimizer state are distributed.

    One member per strategy; what each one is lives in its spec
    (``fsdp_workflow.config.strategies``, and ``fsdp_workflow.train.strategies`` for the trainer).
    """


class ShardingStrategy(str, Enum):
    """FSDP1 sharding strategy (FSDP2 expresses it with ``reshard_after_forward``)."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"


class BackwardPrefetch(str, Enum):
    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"
    NO_PREFETCH = "NO_PREFETCH"


class ContextParallelImpl(str, Enum):
    """How ``strategy.context_parallel_size > 1`` splits each sequence (docs/parallelism.md)."""

    ulysses = "ulysses"  # all-to-all: a slice of the positions outside attention, a slice of the heads inside
    ring = "ring"  # torch's ring-attention context parallel: not built, refused


class ModelInit(str, Enum):
    """``pretrained`` loads weights from ``model.name_or_path``; ``random`` builds from the shape fields."""

    pretrained = "pretrained"
    random = "random"


class DataSource(str, Enum):
    synthetic = "synthetic"  # random token ids; for smoke runs and benchmarks
    text = "text"  # plain text file(s), one document per blank-line-separated block
    jsonl = "jsonl"  # JSON lines with a text field
    parquet = "parquet"  # Parquet file(s) with a text column
    hf_disk = "hf_disk"  # a dataset saved with datasets.save_to_disk


class DataFormat(str, Enum):
    text = "text"  # plain text (data.text_field): every token is trained
    conversation = "conversation"  # messages: [{role, content}] (or ShareGPT conversations: [{from, value}]), chat template
    prompt_completion = "prompt_completion"  # prompt + completion fields: the completion is trained
    alpaca = "alpaca"  # instruction / input / output: the output is trained


class TrainOn(str, Enum):
    assistant = "assistant"  # every assistant turn (the completion, the output); never system or user turns
    last_assistant = "last_assistant"  # only the final assistant turn of each conversation
    all = "all"  # every token but padding


class OnBadRecord(str, Enum):
    fail = "fail"  # stop, naming the first bad records with file and line
    skip = "skip"  # leave them out and count them


class Overlong(str, Enum):
    truncate = "truncate"  # keep the first train.seq_len tokens
    drop = "drop"  # leave the sample out


# Canonical names of the record fields; data.fields maps them to a dataset's own names.
DATA_FIELDS = ("messages", "role", "content", "prompt", "completion", "instruction", "input", "output", "system",
               "history")


class OptimizerName(str, Enum):
    adamw = "adamw"  # torch.optim.AdamW, fused where the device supports it
    adamw_torch_8bit = "adamw_torch_8bit"  # torchao's 8-bit AdamW; works with FSDP2 DTensors
    adamw_8bit = "adamw_8bit"  # bitsandbytes 8-bit AdamW
    adamw_bnb_8bit = "adamw_bnb_8bit"  # alias of adamw_8bit (HF Trainer name)
    sgd = "sgd"

    @property
    def is_8bit(self) -> bool:
        """An 8-bit optimizer (torchao or bitsandbytes): its state is quantised."""
        return self in EIGHT_BIT_OPTIMIZERS

    @property
    def is_bitsandbytes(self) -> bool:
        """bitsandbytes' AdamW8bit (``adamw_8bit`` and its HF Trainer alias): CUDA only, no DTensors."""
        return self in (OptimizerName.adamw_8bit, OptimizerName.adamw_bnb_8bit)


# The one list of 8-bit optimizers: validation and the trainer's optimizer factory read it.
EIGHT_BIT_OPTIMIZERS = frozenset({OptimizerName.adamw_torch_8bit, OptimizerName.adamw_8bit, OptimizerName.adamw_bnb_8bit})


class SchedulerName(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class ClusterKind(str, Enum):
    local = "local"  # run on this machine with torchrun
    slurm = "slurm"  # submit a Slurm job chain


class Launcher(str, Enum):
    """Per-node launcher. ``torchrun`` keeps FSDP even with one process (see docs/strategies.md)."""

    torchrun = "torchrun"
    accelerate = "accelerate"


class RankStart(str, Enum):
    """How torchrun starts a node's ranks (docs/training.md, "How the ranks start")."""

    auto = "auto"  # preloaded on cpu; exec on cuda until a GPU run has confirmed preloaded there
    exec = "exec"  # torchrun -m: each rank a fresh interpreter, importing torch, transformers and the trainer
    preloaded = "preloaded"  # python -m fsdp_workflow.train.node: ranks forked from one process that imported them once


class ContainerRuntime(str, Enum):
    """Where each step runs; each value is one class in ``fsdp_workflow/container/`` (docs/containers.md)."""

    none = "none"  # on the host
    apptainer = "apptainer"  # apptainer exec IMAGE.sif
    pyxis = "pyxis"  # srun --container-image (Slurm's pyxis plugin, enroot)
    charliecloud = "charliecloud"  # ch-run IMAGE_DIR


class Tracker(str, Enum):
    """An experiment tracker ``train.report_to`` logs to, through Accelerate (docs/observability.md)."""

    tensorboard = "tensorboard"
    mlflow = "mlflow"
    wandb = "wandb"
    trackio = "trackio"
    none = "none"  # no tracker (the same as an empty list)


class LogLevel(str, Enum):
    """Verbosity of every stage's log (rank 0; other ranks log warnings); DEBUG adds tracebacks of user errors."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class OutputDtype(str, Enum):
    auto = "auto"  # the base model's own dtype (its config.json's); keep for random init (config/model_dir.py)
    keep = "keep"  # keep the dtype the checkpoint stores (fp32: the master weights)
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


# --------------------------------------------------------------------------- groups
@dataclass
class ModelConfig:
    """The causal LM to fine-tune. Shape fields drive random init and the memory estimate.

    With ``name_or_path`` set, the directory's ``config.json`` sets the model_type,
    architecture, decoder_layer_cls, shape fields and tie (a differing value here is
    replaced, with a note): config/model_dir.py, docs/models.md.
    """

    name: str = MISSING  # short label used in run names and summaries
    # null: pretrained when name_or_path is set, else random; random with name_or_path: its architecture, new weights
    init: Optional[ModelInit] = None
    name_or_path: Optional[str] = None  # local HF model directory, or a hub id already in the local HF cache
    tokenizer: Optional[str] = None  # local tokenizer dir; None: name_or_path, or a byte-level one for random init
    model_type: str = "llama"  # transformers model_type used for random init
    architecture: str = "LlamaForCausalLM"  # transformers class name
    decoder_layer_cls: str = "LlamaDecoderLayer"  # FSDP wrap unit / activation-checkpoint unit
    vocab_size: int = bounded(32000, ge=1)
    hidden_size: int = bounded(4096, ge=1)
    intermediate_size: int = bounded(14336, ge=1)
    num_hidden_layers: int = bounded(32, ge=1)
    num_attention_heads: int = bounded(32, ge=1)
    num_key_value_heads: int = bounded(8, ge=1)
    max_position_embeddings: int = bounded(8192, ge=1)  # longest sequence the model supports, in tokens
    rope_theta: float = bounded(500000.0, gt=0)
    tie_word_embeddings: bool = False
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False  # HF gradient checkpointing (do not combine with FSDP's)
    trust_remote_code: bool = False
    extra_config: Dict[str, Any] = field(default_factory=dict)  # HF config fields set on top (rope_scaling...)
    # MoE only: weight of the router's load-balancing loss added to the step loss (a dimensionless
    # coefficient on transformers' load_balancing_loss_func). None: the model config's own
    # router_aux_loss_coef; 0: off; a value: that coefficient. Logged as aux_loss in metrics.jsonl.
    router_aux_loss_coef: Optional[float] = bounded(None, ge=0)


@dataclass
class SourceConfig:
    """One source of a mixture (``data.sources``): its files, how to read them, and its share.

    Unset keys (null) take the ``data.*`` value of the same name. Give a source
    ``weight`` or ``num_samples``, and every source the same one of the two
    (docs/data.md, "Mixtures").
    """

    path: str = MISSING  # file, directory or glob (a save_to_disk directory for hf_disk)
    name: Optional[str] = None  # shown in the summary, status and meta.json; None: the file name of path
    source: Optional[DataSource] = None  # how records are read; None: data.source
    format: Optional[DataFormat] = None  # what a record holds; None: data.format
    text_field: Optional[str] = None  # format=text: the text field; None: data.text_field
    fields: Optional[Dict[str, str]] = None  # canonical name -> this source's field name; None: data.fields
    weight: Optional[float] = None  # relative share of the training documents (normalised over the sources), > 0
    num_samples: Optional[int] = None  # exactly this many training documents (repeats the source when larger)


@dataclass
class DataConfig:
    """Where training text comes from and how it is turned into packed sequences."""

    source: DataSource = DataSource.synthetic
    path: Optional[str] = None  # file, directory or glob; unused for synthetic. One source; data.sources: several
    sources: List[SourceConfig] = field(default_factory=list)  # a mixture (instead of data.path), mixed by data.seed
    format: DataFormat = DataFormat.text  # what a record holds, hence what is trained (see TrainOn)
    text_field: str = "text"  # JSONL/Parquet/HF column holding the text (format=text)
    fields: Dict[str, str] = field(default_factory=dict)  # canonical name (DATA_FIELDS) -> the dataset's field name
    # The template to train with, named by the user (command line or their own experiment): a shipped name
    # (chatml), a Jinja template or a .jinja file. None: the model directory's own (its tokenizer's).
    chat_template: Optional[str] = None
    # The template for a tokenizer with none of its own (the tiny models' byte-level one): what shipped
    # experiments name. A directory's own template, and data.chat_template, win over it (docs/data.md).
    fallback_chat_template: Optional[str] = None
    train_on: TrainOn = TrainOn.assistant  # which tokens carry loss (format=text trains all)
    on_bad_record: OnBadRecord = OnBadRecord.fail  # a record lacking fields, with an unknown role or an empty answer
    # Train answers that no user turn precedes (system + assistant, an empty prompt); false: such a record is bad
    allow_no_user: bool = False
    overlong: Overlong = Overlong.truncate  # a sample longer than train.seq_len
    cache_dir: Optional[str] = None  # None: RUN_DIR/data_cache; a shared directory reuses caches across runs
    num_workers: Optional[int] = bounded(None, ge=1)  # prepare processes; None: the CPUs this process may use
    eval_path: Optional[str] = None  # held-out data for perplexity; None: hold out eval_fraction
    eval_fraction: float = bounded(0.05, ge=0, lt=1)  # share of documents held out when eval_path is None
    add_eos: bool = True  # append EOS after each document (format=text)
    seed: int = bounded(1234, ge=0)  # shuffling and mixing seed (independent of train.seed)


@dataclass
class StrategyConfig:
    """Distribution strategy. Turned into Accelerate's environment by config/accelerate_env.py."""

    name: StrategyName = MISSING
    # FSDP (1 and 2)
    auto_wrap_policy: AutoWrapPolicy = AutoWrapPolicy.TRANSFORMER_BASED_WRAP
    min_num_params: Optional[int] = bounded(None, ge=1)  # SIZE_BASED_WRAP threshold, in parameters
    reshard_after_forward: bool = True  # FSDP2: free gathered params after forward (ZeRO-3 style)
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD  # FSDP1 only
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.BACKWARD_PRE  # FSDP1 only
    forward_prefetch: bool = False  # FSDP1 only
    offload_params: bool = False  # keep sharded params on CPU
    # Recompute decoder-layer activations in backward (FSDP only): none | full | every_n_layers | ops.
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    activation_checkpointing_every_n_layers: int = bounded(2, ge=2)  # every_n_layers: the 1st, N+1th... layer
    cpu_ram_efficient_loading: bool = True  # load weights on rank 0 only, others on meta
    sync_module_states: bool = True  # broadcast rank 0's weights (FSDP1 needs it with the above)
    use_orig_params: bool = True  # FSDP1 only
    # DeepSpeed
    zero_stage: Optional[int] = bounded(None, ge=1, le=3)  # 1, 2 or 3 for the deepspeed_* strategies
    offload_optimizer_device: OffloadDevice = OffloadDevice.none
    offload_param_device: OffloadDevice = OffloadDevice.none
    offload_nvme_path: Optional[str] = None  # local NVMe directory, needed when an offload device is nvme
    zero3_init_flag: bool = True  # build the model partitioned under ZeRO-3
    # The device mesh, dp_replicate x dp_shard x cp x tp = world size (dp_shard is what is left);
    # FSDP2 only. See docs/parallelism.md.
    dp_replicate_size: int = bounded(1, ge=1)  # model replicas (HSDP): replicate across node groups, shard within
    tensor_parallel_size: int = bounded(1, ge=1)  # ranks splitting each layer's weights (within a node)
    context_parallel_size: int = bounded(1, ge=1)  # ranks splitting each sequence (seq_len / cp positions each)
    context_parallel_impl: ContextParallelImpl = ContextParallelImpl.ulysses  # ulysses; ring is refused (not built)


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = bounded(2.0e-5, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = bounded(1.0e-8, gt=0)
    fused: Optional[bool] = None  # None: fused where the device supports it
    scheduler: SchedulerName = SchedulerName.cosine
    warmup_steps: int = bounded(0, ge=0)  # linear warmup, in optimizer steps
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)  # lr at train.max_steps as a fraction of lr (cosine/linear; 0 = HF's schedules)
    max_grad_norm: Optional[float] = bounded(1.0, gt=0)  # None disables clipping


@dataclass
class ClusterConfig:
    """Where the job runs. Every #SBATCH option a site needs is reachable here."""

    kind: ClusterKind = ClusterKind.local
    device: Device = Device.cuda
    nodes: int = bounded(1, ge=1)
    processes_per_node: int = bounded(1, ge=1)  # ranks per node: GPUs per node on GPU clusters
    gpu_mem_gb: float = bounded(80.0, gt=0)  # memory of one accelerator, for the memory estimate
    launcher: Launcher = Launcher.torchrun
    rank_start: RankStart = RankStart.auto  # torchrun only: fresh interpreters (exec) or forked after one import
    # Slurm: training job
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = bounded(60, ge=1)  # wall-clock limit of the training job, in minutes
    mem_gb: Optional[int] = bounded(None, ge=1)  # memory per node, in GB (None: site default)
    cpus_per_task: int = bounded(8, ge=1)  # one task per node runs the node's launcher
    gpus_per_node: Optional[int] = bounded(None, ge=0)  # None: processes_per_node when device=cuda, 0 on cpu
    constraint: Optional[str] = None
    exclusive: bool = False
    additional_parameters: Dict[str, str] = field(default_factory=dict)  # more #SBATCH key=value
    modules: List[str] = field(default_factory=list)  # environment modules loaded in every job (`module load X`)
    env_script: Optional[str] = None  # a site script sourced in every job before the step (e.g. a venv's activate)
    signal_delay_s: int = bounded(300, ge=0)  # SIGUSR2 this long before the time limit: checkpoint and requeue
    max_requeues: int = bounded(3, ge=0)  # bounded retries after preemption/timeout
    master_port_base: int = bounded(20000, ge=1024, le=65535)  # rendezvous port = base + job_id % port_range (below the ephemeral range)
    port_range: int = bounded(10000, ge=1, le=64511)
    rdzv_timeout_s: int = bounded(600, ge=1)  # rendezvous / collective timeout: a dead node fails the step this fast
    nccl_env: Dict[str, str] = field(default_factory=dict)  # NCCL_* and other presets
    log_dir: Optional[str] = None  # None: RUN_DIR/logs
    # Copy the package into RUN_DIR/code when the run is planned and put it first on every job's
    # PYTHONPATH (natively and in containers), so a queued job runs the code that was submitted
    # (docs/slurm.md, "Code snapshot"). false: jobs import whatever is installed when they start.
    code_snapshot: bool = True
    # Before submitting, read the partitions, nodes and QoS/association limits (scontrol, sinfo, sacctmgr) and
    # refuse a chain Slurm would queue but never start (docs/slurm.md, "What is checked before the queue").
    # false: submit without reading them (a site where these commands are restricted); pending reasons that
    # mean "never" are still read right after submitting.
    check_limits: bool = True
    # Before torchrun starts, one task per node of the training job checks the run directory, the code and
    # torch/transformers versions, the GPUs, the master address and port, and a tiny all-reduce (seconds;
    # docs/slurm.md, "Preflight"). A failure ends the job with exit 66, naming the node. false: not rendered.
    preflight: bool = True
    # Slurm: consolidation job (CPU only)
    consolidate_partition: Optional[str] = None  # None: partition
    consolidate_time_min: int = bounded(60, ge=1)
    consolidate_mem_gb: int = bounded(8, ge=1)
    consolidate_cpus: int = bounded(2, ge=1)


@dataclass
class ContainerConfig:
    """Run each step inside an image."""

    runtime: ContainerRuntime = ContainerRuntime.none
    image: Optional[str] = None  # .sif path (apptainer), image reference (pyxis), image directory (charliecloud)
    binds: List[str] = field(default_factory=list)  # extra host paths (src[:dst[:opts]])
    env: Dict[str, str] = field(default_factory=dict)  # variables set inside the container
    extra_args: List[str] = field(default_factory=list)  # more runtime arguments, passed as given


@dataclass
class TrainConfig:
    max_steps: int = bounded(1000, ge=1)  # optimizer steps
    seq_len: int = bounded(2048, ge=1)  # packed sequence length, in tokens
    micro_batch_size: int = bounded(1, ge=1)  # sequences per rank per forward
    grad_accum_steps: int = bounded(1, ge=1)
    global_batch_size: Optional[int] = bounded(None, ge=1)  # sequences per optimizer step; checked if set
    mixed_precision: MixedPrecision = MixedPrecision.bf16
    seed: int = bounded(42, ge=0)
    log_every_steps: int = bounded(10, ge=1)
    eval_every_steps: int = bounded(0, ge=0)  # 0: no in-loop evaluation
    eval_batches: int = bounded(8, ge=1)
    # torch.compile each decoder layer after wrapping. None: settled at planning (config/device_defaults.py):
    # on for FSDP2 on CUDA without tp/cp (the measured fast path), off elsewhere; config.yaml records the answer.
    compile: Optional[bool] = None
    # float8 matmuls in the large nn.Linear layers through torchao (`pip install 'fsdp_workflow[float8]'`);
    # CUDA with compute capability >= 8.9 (H100, H200, L40S...); lm_head and small layers stay in bf16.
    float8: bool = False
    peak_tflops: Optional[float] = bounded(None, gt=0)  # per device, for MFU; None: guessed from the device name
    # EMA of the weights (docs/training.md, "EMA"): fp32, sharded like the parameters, saved under "ema".
    ema_decay: Optional[float] = bounded(None, gt=0, lt=1)  # ema = decay*ema + (1-decay)*weights; None: no EMA
    ema_every_steps: int = bounded(1, ge=1)  # update the EMA every N optimizer steps (after ema_start_step)
    ema_start_step: int = bounded(0, ge=0)  # up to this optimizer step the EMA equals the weights
    report_to: List[Tracker] = field(default_factory=list)  # experiment trackers (rank 0 logs metrics.jsonl there); []: none
    # [FIRST, LAST]: torch.profiler over these optimizer steps (1-based, inclusive) into RUN_DIR/profile/
    # (a Chrome trace and a key_averages table per rank; docs/training.md, "Profiling"); None: no profile
    profile_steps: Optional[List[int]] = None


@dataclass
class CheckpointConfig:
    every_steps: int = bounded(500, ge=0)  # save a sharded checkpoint every N optimizer steps; 0: only at the end
    keep_last: int = bounded(3, ge=0)  # prune older checkpoints; 0 keeps all
    async_save: bool = False  # DCP async save: the loop stalls only for the device-to-host copy
    resume: str = "auto"  # auto | none | path to a checkpoints/step-N directory
    save_final: bool = True  # checkpoint after the last step


@dataclass
class ConsolidateConfig:
    enabled: bool = True  # run the dependent consolidation step after training
    dtype: OutputDtype = OutputDtype.auto  # auto: a fine-tuned bf16 model is written in bf16, as it came
    max_shard_size: str = "5GB"
    output_dir: Optional[str] = None  # None: RUN_DIR/hf_model
    every_checkpoint: bool = False  # consolidate and evaluate each saved checkpoint (Slurm)
    remove_sharded: bool = False  # delete the shards after a verified consolidation
    verify: bool = True
    allow_nonfinite: bool = False  # write NaN/inf weights on purpose (--allow-nonfinite); else the job refuses, exit 65


@dataclass
class WorkflowConfig:
    """The root config: ``python -m fsdp_workflow`` composes exactly this."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: StrategyConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    cluster: ClusterConfig = MISSING
    container: ContainerConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    consolidate: ConsolidateConfig = field(default_factory=ConsolidateConfig)
    run_dir: str = MISSING  # where config, scripts, logs, checkpoints and the model go
    dry_run: bool = False  # plan and write scripts, submit nothing
    name: str = "run"  # job name prefix on Slurm; also the tracker experiment / project name
    log_level: LogLevel = LogLevel.INFO  # DEBUG | INFO | WARNING | ERROR, every stage; DEBUG: full tracebacks of user errors


def rank_start(cfg: WorkflowConfig) -> RankStart:
    """``cluster.rank_start`` resolved: ``auto`` is ``preloaded`` for torchrun on CPU, else ``exec``.

    Not yet on CUDA by itself: the forkserver imports nothing that initialises CUDA, but
    no GPU run has confirmed the start there yet (docs/training.md, "How the ranks start").
    """
    c = cfg.cluster
    if c.rank_start != RankStart.auto:
        return c.rank_start
    return RankStart.preloaded if c.launcher == Launcher.torchrun and c.device == Device.cpu else RankStart.exec


def world_size(cfg: WorkflowConfig) -> int:
    """Total ranks: nodes x processes per node."""
    return cfg.cluster.nodes * cfg.cluster.processes_per_node


def run_layout(cfg: WorkflowConfig) -> RunDir:
    """The run directory's paths for this config (``cluster.log_dir``, ``consolidate.output_dir`` applied)."""
    return RunDir.of(cfg.run_dir, cfg.cluster.log_dir, cfg.consolidate.output_dir)


def data_parallel_size(cfg: WorkflowConfig) -> int:
    """Ranks that see different data: world / (tensor parallel x context parallel) = dp_replicate x dp_shard."""
    model_parallel = cfg.strategy.tensor_parallel_size * cfg.strategy.context_parallel_size
    return max(world_size(cfg) // max(model_parallel, 1), 1)


MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # outermost first, Accelerate's ParallelismConfig order


def mesh_shape(cfg: WorkflowConfig) -> Dict[str, int]:
    """The device mesh the trainer builds, ``{dim: size}`` in :data:`MESH_DIMS` order.

    ``dp_shard`` is what the other dimensions leave of the world size (validation
    refuses a world they do not divide). TP is innermost, so a TP group is
    consecutive ranks, which torchrun places on one node.
    """
    s = cfg.strategy
    rep, cp, tp = s.dp_replicate_size, s.context_parallel_size, s.tensor_parallel_size
    return {"dp_replicate": rep, "dp_shard": max(world_size(cfg) // max(rep * cp * tp, 1), 1), "cp": cp, "tp": tp}


# Values earlier versions took for a key that is now a choice, and what they mean now: the boolean
# activation_checkpointing was before selective checkpointing. Composition lets any value through
# these keys (an Enum node refuses a bool while Hydra merges a YAML file, before our code runs);
# config.load spells the old value as this version does and types the key as its Enum again.
RENAMED_VALUES: Dict[tuple, Dict[Any, str]] = {("strategy", "activation_checkpointing"): {True: "full", False: "none"}}


def _composition_schema(cls: type, group: str) -> Any:
    """``cls`` as Hydra composes it: its structured config, with the renamed keys of ``group`` untyped."""
    from omegaconf import OmegaConf, flag_override

    node = OmegaConf.structured(cls)
    for section, key in RENAMED_VALUES:
        if section == group:
            default = node[key]
            with flag_override(node, "struct", False):  # a structured config allows no deletion otherwise
                del node[key]
                node[key] = default.name  # an AnyNode: config.load.to_typed checks and types it
    return node


@functools.cache
def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (YAML files name these in their defaults).

    Once per process: the store outlives ``GlobalHydra.clear()``, and building the structured
    nodes again was a quarter of every ``compose`` (tests and notebooks compose hundreds of times).
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    root = OmegaConf.structured(WorkflowConfig)
    # Given in the root too: Hydra fills a missing group from the field's type, which would type the key again.
    root.strategy = _composition_schema(StrategyConfig, "strategy")
    cs.store(name="workflow_schema", node=root)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="strategy", name="strategy_schema", node=_composition_schema(StrategyConfig, "strategy"))
    cs.store(group="optimizer", name="optimizer_schema", node=OptimizerConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="container", name="container_schema", node=ContainerConfig)
