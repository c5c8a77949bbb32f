"""The word-cache tokeniser (fsdp_workflow/data/wordcache.py) gives exactly the Rust tokenizer's ids, offsets and masks.

Both paths are run on every chat family of test_families.py (their stock
templates, their special tokens, conversations with and without system turns
and reasoning, ASCII, CJK, emoji and code), on GPT-2, Llama-3 and Qwen2 style
pre-tokenizers (Split + ByteLevel, an NFC normaliser) trained on text with
multi-byte characters, over hand-picked awkward strings and random strings of
code points from all of Unicode, and the shapes the word cache must refuse are
refused. Where it refuses a text (a character the two regex engines class
differently, one that may case-fold or normalise), the Rust tokenizer's answer
is used, so either way the ids and offsets are the Rust tokenizer's.
"""

from __future__ import annotations

import json
import random
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
# CJK without spaces, emoji sequences (ZWJ, skin tone, flag, variation selector), combining marks in and out of NFC,
# other scripts, code with unicode, control and space characters, case folds (ſ, K, İ, ß), a letter the two regex
# engines class differently (U+A7CE: a letter to Python's regex, not yet to the Rust tokenizer's Oniguruma)
UNICODE_STRINGS = [
    "分布式训练：梯度同步，参数切分。你好！", "東京は晴れ。ひらがなカタカナ漢字、コードを直す", "２０２６年 ①② Ⅻ ½ x² ٣",
    " 👩\u200d💻🇯🇵 👍🏽❤️ 🚀🚀 ok🎉", "e\u0301 a\u0308\u0301 ﬁx é", "Привет, мир! Γειά σου 안녕하세요 مرحبا नमस्ते ไทย",
    "def größe(città='值'):  # ✓ λ\n\treturn f\"{città} 🔥\"  // “quoted” → …", "x\x0by\x0cz\x1c\x1f\x85\u2028\u3000end",
    "DON'ſ it'K 'İ Straße 'ß", "\u00a0 \u2009x\u00a0\n\n  \u3000", "naïve café — Grüße", "x\ua7cey \ua7ce a\ua7ce",
    "混合 mixed 文本123abc😀", "\ufeffBOM and \u200b zero width", "🏳️\u200d🌈 family: 👨\u200d👩\u200d👧",
]
STRINGS = ["Hello, world! It's 1234567 o'clock.", "DON'T shout'LL\r\n\r\n\tindent   x", "  ", "",
           "a <|im_end|>b<|im_start|>  c", "1.5e10 and 0x1F!", "naïve café", "tab\tand\x0bvt", "end\n"]


def _both(tok: Any, template: str, records: List[Any]) -> Tuple[Any, Any, int]:
    """encode_chunk's result with the word cache and without it, and how many documents the cache encoded."""
    used = []
    original = WordCache.encode

    def counting(self: WordCache, text: str) -> Any:
        got = original(self, text)
        if encode_mod._STATE.get("words") is self:  # a document's, not one of for_tokenizer's probes
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


MIXED_RECORDS = [
    [{"role": "user", "content": "请用Python写一个函数，输出“Grüße”。"},
     {"role": "assistant", "content": "好的：\n```python\ndef größe(città: str) -> str:\n    # 返回问候 🚀\n"
                                      "    return f\"Grüße, {città} 👩\u200d💻\"\n```"}],
    [{"role": "user", "content": "分散学習について教えてください。"},
     {"role": "assistant", "content": "データ並列では、各GPUにモデルのコピーを置きます。勾配は平均されます！"}],
    [{"role": "user", "content": "e\u0301 or é? ſ and K, naïve\u00a0café"},
     {"role": "assistant", "content": "Both — “é” (NFC) 👍🏽 and \u3000 ideographic space; 🇯🇵 flag ✓"}],
]


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
    records += [{"messages": [m for m in r if fam.system or m["role"] != "system"]}
                for r in ASCII_RECORDS + MIXED_RECORDS]
    with_cache, without, used = _both(tok, tok.chat_template, records)
    # every document is the cache's: CJK, emoji and combining marks included (these tokenizers have no normaliser)
    assert used == len(records), f"{name}: the word cache encoded only {used} of {len(records)} documents"
    assert not with_cache.bad and not without.bad
    np.testing.assert_array_equal(with_cache.lengths, without.lengths)
    np.testing.assert_array_equal(with_cache.tokens, without.tokens)
    np.testing.assert_array_equal(with_cache.labels, without.labels)


def _tokenizer(pre: Any, normalizer: Any = None, post: Any = None, specials: Tuple[str, ...] = (),
               extra: Tuple[Path, ...] = ()) -> Any:
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
    tok.train([str(CORPUS), *map(str, extra)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def _shape(name: str, extra: Tuple[Path, ...] = ()) -> Any:
    """A tokenizer of GPT-2's, Llama 3's or Qwen2's shape (Split + ByteLevel; Qwen2 with NFC)."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if name == "gpt2":
        return _tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), extra=extra)
    pattern = LLAMA3_PATTERN if name == "llama3" else QWEN2_PATTERN
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return _tokenizer(pre, normalizers.NFC() if name == "qwen2" else None, extra=extra)


@pytest.fixture(scope="module")
def unicode_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Training text with multi-byte characters, so that merges make tokens of several characters and of part of one."""
    path = tmp_path_factory.mktemp("unicode") / "text.txt"
    # "a" before letters whose first UTF-8 byte is U+A7CE's (0xEA) and whose second bytes differ: a merge of "a" with
    # that byte, so that "a\ua7ce" as one word (Python's regex) or two (Oniguruma) gives different ids
    path.write_text("\n".join(UNICODE_STRINGS * 20 + [m["content"] for r in MIXED_RECORDS for m in r] * 20
                              + [" ".join("a" + chr(c) for c in range(0xA000, 0xA600, 0x100))] * 200))
    return path


def _random_strings(n: int, seed: int = 0) -> List[str]:
    """Strings of code points from all of Unicode (assigned or not, controls too), mixed with ASCII words and spaces."""
    rng = random.Random(seed)
    pools = ["abc XYZ 123 's 'LL ", " \t\n\r", "\u00e9\u0301\u0308\u00df\u017f\u212a\u0130"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.5:
                parts.append("".join(rng.choices(rng.choice(pools), k=rng.randint(1, 4))))
            else:  # any code point but a surrogate (a Python str only; never valid UTF-8)
                parts.append("".join(chr(c if not 0xD800 <= c <= 0xDFFF else 0x41)
                                     for c in (rng.choice([rng.randint(0x80, 0x3000), rng.randint(0, 0x2FFFF)])
                                               for _ in range(rng.randint(1, 4)))))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("shape", ["gpt2", "llama3", "qwen2"])
def test_unicode_text_gives_the_rust_tokenizers_ids_and_offsets(unicode_text: Path, shape: str) -> None:
    """Every text the cache serves is exact; it serves the usual unicode text, and refuses only what it must."""
    import unicodedata

    from fsdp_workflow.data.wordcache import _matched

    tok = _shape(shape, (unicode_text,))
    cache = WordCache.for_tokenizer(tok)
    assert cache is not None
    texts = UNICODE_STRINGS + STRINGS + CORPUS.read_text().split("\n\n")[:20] + _random_strings(400)
    texts += [f"{a}<|im_end|>{b}" for a, b in zip(UNICODE_STRINGS, reversed(UNICODE_STRINGS))]
    refs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    served = set()
    for text, ref in zip(texts, refs):
        got = cache.encode(text)
        if got is not None:
            served.add(text)
            assert got[0].tolist() == ref.ids, text
            assert [tuple(o) for o in got[1].tolist()] == ref.offsets, text
    # served: the CJK, emoji, code and script strings, whatever the shape
    for text in UNICODE_STRINGS[:4] + UNICODE_STRINGS[5:7] + UNICODE_STRINGS[12:]:
        assert text in served, (shape, text)
    # refused only where the cache cannot be sure: a letter the engines class differently, a case fold, a
    # normaliser's work left to do
    rust, python = _matched(r"\p{L}", "\ua7ce")
    assert (UNICODE_STRINGS[11] not in served) == (rust != python)
    assert not unicodedata.is_normalized("NFC", UNICODE_STRINGS[4])
    assert (UNICODE_STRINGS[4] in served) == (shape != "qwen2")  # e + combining acute, under NFC
    assert (UNICODE_STRINGS[8] in served) == (shape == "gpt2")  # ſ/K/İ beside a (?i:'s|...) group
    assert all(text in served for text in texts if text.isascii())
    # refused only where it must: each refused text holds a character the two engines class differently (or a case
    # fold, or the normaliser's work left to do), found by asking Oniguruma itself. Which characters those are moves
    # with the regex release's Unicode tables (regex 2026.12 refuses about 20 more of the random strings' characters
    # than 2026.5), so the floor below is loose and the refusals are checked one by one.
    for text in texts:
        if text not in served:
            assert any(piece and not cache._unicode_ok(piece) for piece in text.split("<|im_end|>")), (shape, text)
    assert len(served) >= 0.4 * len(texts)


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


def test_non_ascii_and_control_characters_give_the_rust_tokenizers_answer(bpe_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
    cache = WordCache.for_tokenizer(tok)
    assert cache is not None
    for text in ("caf\u00e9", "a\x0cb", "a\x1fb", "\U0001f680 x", "é<|im_end|>é"):
        ids, offsets = cache.encode(text)  # type: ignore[misc]
        ref = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        assert (ids.tolist(), [tuple(o) for o in offsets.tolist()]) == (ref.ids, ref.offsets), text
    assert cache.encode("a\ud800b") is None  # a lone surrogate is no UTF-8: the Rust tokenizer says what it says
    ids, offsets = cache.encode("plain text<|im_end|>\n")  # type: ignore[misc]
    assert offsets[-1].tolist() == [len("plain text<|im_end|>"), len("plain text<|im_end|>\n")]
    assert json.dumps(ids.tolist())  # int32 ids, one per token
