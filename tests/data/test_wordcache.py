"""The word-cache tokeniser (fsdp_workflow/data/wordcache.py) gives exactly the Rust tokenizer's ids, offsets and masks.

Both paths are run on every chat family of test_families.py (their stock
templates, their special tokens, conversations with and without system turns
and reasoning, ASCII and not), on Llama-3 and Qwen2 style pre-tokenizers
(Split + ByteLevel, an NFC normaliser), and the shapes the word cache must
refuse are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from fsdp_workflow.data import encode as encode_mod
from fsdp_workflow.data.wordcache import WordCache

from .conftest import CORPUS
from .test_families import FAMILIES, conversation, encode, make_tokenizer

ASCII_RECORDS = [
    [{"role": "user", "content": "Don't   stop;\tit's 12345 o'clock!!\r\nOK?"},
     {"role": "assistant", "content": "We'LL see... (maybe) 'VE  \n\n  trailing   "}],
    [{"role": "system", "content": "  Lead spaces and 3.14159 digits  "},
     {"role": "user", "content": "a\n\n\nb"}, {"role": "assistant", "content": "x2y3 z_9 ~`@#$%^&*"}],
    [{"role": "user", "content": "Say <|im_end|> or <eos> or [INST] verbatim"},
     {"role": "assistant", "content": "I wrote <|im_end|><|im_start|> and </s> right here."}],
]
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
STRINGS = ["Hello, world! It's 1234567 o'clock.", "DON'T shout'LL\r\n\r\n\tindent   x", "  ", "",
           "a <|im_end|>b<|im_start|>  c", "1.5e10 and 0x1F!", "naïve café", "tab\tand\x0bvt", "end\n"]


def _both(tok: Any, template: str, records: List[Any]) -> Tuple[Any, Any, int]:
    """encode_chunk's result with the word cache and without it, and how many documents the cache encoded."""
    used = []
    original = WordCache.encode

    def counting(self: WordCache, text: str) -> Any:
        got = original(self, text)
        used.append(got is not None)
        return got

    WordCache.encode = counting  # type: ignore[method-assign]
    try:
        with_cache = encode(tok, template, records)
    finally:
        WordCache.encode = original  # type: ignore[method-assign]
    assert encode_mod._STATE["words"] is not None, "the family tokenizer should take the word-cache path"
    spec = encode_mod._STATE["spec"]
    encode_mod._STATE["words"] = None  # the Rust tokenizer for everything
    without = encode_mod.encode_chunk(("mem.jsonl", list(enumerate(records, 1))))
    assert encode_mod._STATE["spec"] is spec
    return with_cache, without, sum(used)


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return {name: make_tokenizer(fam, tmp_path_factory.mktemp(name)) for name, fam in FAMILIES.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_word_cache_equals_rust_tokenizer_on_every_family(family_tokenizers: Dict[str, Any], name: str) -> None:
    fam = FAMILIES[name]
    tok = family_tokenizers[name]
    records = [{"messages": conversation(fam, n, system, reasoning)} for n in (1, 3)
               for system in ((False, True) if fam.system else (False,))
               for reasoning in ((False, True) if fam.reasoning else (False,))]
    records += [{"messages": [m for m in r if fam.system or m["role"] != "system"]} for r in ASCII_RECORDS]
    with_cache, without, used = _both(tok, tok.chat_template, records)
    assert used >= len(ASCII_RECORDS), f"{name}: the word cache encoded only {used} documents"
    assert not with_cache.bad and not without.bad
    np.testing.assert_array_equal(with_cache.lengths, without.lengths)
    np.testing.assert_array_equal(with_cache.tokens, without.tokens)
    np.testing.assert_array_equal(with_cache.labels, without.labels)


def _tokenizer(pre: Any, normalizer: Any = None, post: Any = None, specials: Tuple[str, ...] = ()) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    if post is not None:
        tok.post_processor = post
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(specials) or ["<|im_end|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(CORPUS)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@pytest.mark.parametrize("pattern,nfc", [(LLAMA3_PATTERN, False), (QWEN2_PATTERN, True)], ids=["llama3", "qwen2"])
def test_split_byte_level_pretokenizers_give_the_same_ids_and_offsets(pattern: str, nfc: bool) -> None:
    from tokenizers import Regex, normalizers, pre_tokenizers

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = _tokenizer(pre, normalizers.NFC() if nfc else None)
    cache = WordCache.for_tokenizer(tok)
    assert cache is not None
    corpus = CORPUS.read_text().split("\n\n")[:40]
    used = 0
    for text in STRINGS + corpus:
        got = cache.encode(text)
        ref = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        if got is None:
            assert not text.isascii() or "\x0b" in text, f"an ASCII text was refused: {text!r}"
            continue
        used += 1
        assert got[0].tolist() == ref.ids, text
        assert [tuple(o) for o in got[1].tolist()] == ref.offsets, text
    assert used >= len(corpus)


def test_shapes_the_word_cache_cannot_match_are_refused() -> None:
    from tokenizers import pre_tokenizers, processors

    from fsdp_workflow.data.tokenizer import byte_level_tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert WordCache.for_tokenizer(_tokenizer(byte_level)) is not None
    # offsets trimmed by the post-processor, a prefix space, the whole text as one word, no fast tokenizer
    assert WordCache.for_tokenizer(_tokenizer(byte_level, post=processors.ByteLevel(trim_offsets=True))) is None
    assert WordCache.for_tokenizer(_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=True))) is None
    assert WordCache.for_tokenizer(byte_level_tokenizer()) is None
    # a Split regex whose meaning may differ between Oniguruma and Python (anchors, word boundaries, flags)
    from tokenizers import Regex

    for pattern in (r"^\s+|\S+", r"\b\w+|\s+", r"(?m:.)+|\n"):
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert WordCache.for_tokenizer(_tokenizer(pre)) is None, pattern
    assert WordCache.for_tokenizer(object()) is None


def test_non_ascii_and_control_characters_go_to_the_rust_tokenizer(bpe_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    cache = WordCache.for_tokenizer(AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir)))
    assert cache is not None
    assert cache.encode("caf\u00e9") is None and cache.encode("a\x0cb") is None and cache.encode("a\x1fb") is None
    ids, offsets = cache.encode("plain text<|im_end|>\n")  # type: ignore[misc]
    assert offsets[-1].tolist() == [len("plain text<|im_end|>"), len("plain text<|im_end|>\n")]
    assert json.dumps(ids.tolist())  # int32 ids, one per token
