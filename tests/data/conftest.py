"""Helpers for the data stage's tests: typed configs built in code, small data files, a local BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import pytest

from fsdp_workflow.config.load import ASSETS_DIR
from fsdp_workflow.config.schema import (ClusterConfig, ContainerConfig, DataConfig, ModelConfig, ModelInit,
                                         OptimizerConfig, StrategyConfig, StrategyName, WorkflowConfig)

CORPUS = ASSETS_DIR / "smoke" / "corpus.txt"


def make_cfg(run_dir: Path, seq_len: int = 256, tokenizer: Optional[str] = None, **data: Any) -> WorkflowConfig:
    """A typed config with only what the prepare step reads (byte-level tokenizer unless ``tokenizer``)."""
    model = ModelConfig(name="tiny", init=ModelInit.random, vocab_size=260 if tokenizer is None else 4096,
                        tokenizer=tokenizer)
    cfg = WorkflowConfig(model=model, data=DataConfig(**data), strategy=StrategyConfig(name=StrategyName.ddp),
                         optimizer=OptimizerConfig(), cluster=ClusterConfig(), container=ContainerConfig(),
                         run_dir=str(run_dir))
    cfg.train.seq_len = seq_len
    return cfg


def write_jsonl(path: Path, records: List[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_run_dir(tmp_path: Path, records: List[Any]) -> WorkflowConfig:
    """A run directory (``tmp_path/run`` with its config.yaml) over ``records`` as chatml conversations."""
    from fsdp_workflow.config.load import to_yaml
    from fsdp_workflow.config.schema import DataFormat, DataSource, run_layout

    path = write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = make_cfg(tmp_path / "run", seq_len=256, source=DataSource.jsonl, path=str(path),
                   format=DataFormat.conversation, chat_template="chatml", eval_fraction=0.0)
    layout = run_layout(cfg)
    layout.root.mkdir(parents=True)
    layout.config.write_text(to_yaml(cfg))
    return cfg


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer trained on the shipped corpus, with the chatml specials, saved locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fsdp_workflow.data.templates import SHIPPED_TEMPLATES

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   bos_token="<|endoftext|>")
    fast.chat_template = SHIPPED_TEMPLATES["chatml"]
    out = tmp_path_factory.mktemp("bpe_tokenizer")
    fast.save_pretrained(out)
    return out
