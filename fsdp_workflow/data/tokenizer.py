"""Tokenizers: the model's own from a local directory, or a byte-level one built in code.

Randomly initialised smoke and benchmark models have no tokenizer directory.
For them we build a byte-level tokenizer with no merges: ids 0-255 are the
bytes, then four specials. That is the 260-token vocabulary of the tiny
models in ``conf/model/tiny_*.yaml``. It round-trips any UTF-8 text and is
saved to ``RUN_DIR/hf_assets/`` like any other tokenizer, so the consolidated
model loads with ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from fsdp_workflow.config.schema import ModelConfig

BYTE_SPECIALS = ("<s>", "</s>", "<pad>", "<unk>")
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIALS)


def byte_level_tokenizer() -> Any:
    """Build a ``PreTrainedTokenizerFast`` over the 256 bytes plus ``<s> </s> <pad> <unk>``.

    Returns:
        A fast tokenizer with ``bos``/``eos``/``pad``/``unk`` set; ``eos_token_id`` is 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> printable character table (what ByteLevel pre-tokenizers emit);
    # transformers 5 keeps it here, no longer in models.gpt2.tokenization_gpt2.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order the characters by byte value so that token id == byte value.
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    for i, special in enumerate(BYTE_SPECIALS):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1 << 30,
    )


def tokenizer_source(model_cfg: ModelConfig) -> Optional[str]:
    """The local directory the tokenizer is loaded from, or None for the byte-level one."""
    if model_cfg.tokenizer:
        return model_cfg.tokenizer
    if model_cfg.name_or_path:  # the model's own, for random weights in its architecture too
        return model_cfg.name_or_path
    return None


def load_tokenizer(model_cfg: ModelConfig) -> Any:
    """Load the tokenizer the model config names, offline.

    Args:
        model_cfg: the ``model`` group.

    Returns:
        A transformers tokenizer with an EOS token.

    Raises:
        FileNotFoundError: ``model.tokenizer`` (or ``model.name_or_path``) is not a local directory.
        ValueError: the byte-level tokenizer would not fit ``model.vocab_size``.
    """
    src = tokenizer_source(model_cfg)
    if src is None:
        if model_cfg.vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"model.vocab_size={model_cfg.vocab_size} is too small for the built-in byte-level "
                f"tokenizer ({BYTE_VOCAB_SIZE} tokens). Set model.vocab_size>={BYTE_VOCAB_SIZE} or "
                "point model.tokenizer at a local tokenizer directory."
            )
        return byte_level_tokenizer()
    if not os.path.isdir(src):
        raise FileNotFoundError(
            f"model.tokenizer / model.name_or_path={src!r} is not a local directory. The trainer never "
            "downloads: copy the model (or tokenizer) to shared storage and point the config at it."
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {src!r} has no EOS token; packing needs one between documents")
    return tok
