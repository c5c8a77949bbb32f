"""Byte-level BPE with a word cache: the same ids and offsets as the Rust tokenizer, about 3x faster.

Most of a byte-level BPE tokenizer's time (GPT-2, Llama 3, Qwen2 style) goes to
pre-tokenising, not to the merges: the Rust pipeline splits the text into
words with a regex and then builds, for every byte of every word, the
alignment tables that its offsets come from. For text whose characters are
printable ASCII (plus tab, newline, carriage return) every character is one
byte, so none of that bookkeeping changes anything: a token's characters are
its byte-level string. :class:`WordCache` does the same steps with Python's C
regex engine and a dictionary from each word to its token ids, calling the
tokenizer's own BPE model only for a word not seen before:

1. split the text at the added tokens (leftmost-longest, the non-normalised
   ones first, as ``tokenizers``' ``AddedVocabulary`` does);
2. split each piece into words with the pre-tokenizer's own regex (ASCII
   classes for ``\\p{L}``, ``\\p{N}``, ...);
3. look each word up (on a miss: the model's ``tokenize`` on its byte-level form).

It is used only where it provably gives what ``backend_tokenizer.encode``
gives: :meth:`WordCache.for_tokenizer` accepts a tokenizer only when its
pipeline has exactly this shape (no normaliser but Unicode forms, which leave
ASCII alone; a ByteLevel or Split+ByteLevel pre-tokenizer without a prefix
space; a BPE model without dropout or affixes; added tokens without strip
flags; no truncation, no offset trimming) and a probe set of awkward strings
gives equal ids and offsets both ways. :meth:`WordCache.encode` returns None
for any other text (a non-ASCII or control character outside the added
tokens, words that do not cover the text), and the caller tokenises that text with the Rust tokenizer.
``tests/data/test_wordcache.py`` checks both paths give the same tokens and
masks on every family of ``tests/data/test_families.py``.
"""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any, Dict, List, Optional, Pattern, Tuple

import numpy as np

# GPT-2's pre-tokenizer regex (tokenizers' ByteLevel with use_regex=True)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
MAX_WORDS = 200_000  # cache entries per process (about 50 MB); past this, the cache starts again
_UNSAFE = re.compile(r"[^\t\n\r\x20-\x7e]")  # a character this path does not handle: the Rust tokenizer does
# Unicode classes -> their ASCII members (the only characters this path sees)
_ASCII_CLASSES = {"L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "N": "0-9", "Nd": "0-9",
                  "Lt": "", "Lm": "", "Lo": "", "M": "", "Mn": "", "Mc": "", "Me": "", "Nl": "", "No": ""}
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_ESCAPES = "pPsSrntdDwW"  # escapes that mean the same to Oniguruma and to re.ASCII on the characters seen here
_PROBES = ("Hello, world! It's 42.", "we'll  see\n\n\tthe END'S   \r\nof 1234567 and x2y3", "  lead\nand trail  ",
           "a\r\n\r\nb", "don't!!! ?? ...  ;; (x) [y] {z}", "MiXeD CaSe'LL 'VE 12ab34", "\t\t", " ", "x")


def _ascii_pattern(pattern: str) -> Optional[str]:
    """``pattern`` with ``\\p{..}`` classes spelt in ASCII for Python's ``re``, or None where the two engines may differ.

    Refused: a class not known here, escapes other than :data:`_ESCAPES`, anchors
    (Oniguruma's ``^``/``$`` match at every line), inline flags other than ``i``.
    """
    if re.search(r"\(\?(?![:=!>i]|<[=!])", pattern) or re.search(r"\(\?i[^:)]", pattern):
        return None
    out: List[str] = []
    i, depth = 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c in "^$" and not (depth and c == "^" and pattern[i - 1] == "["):
            return None
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt.isalnum() and nxt not in _ESCAPES:
                return None
            if nxt in "pP":
                m = re.match(r"\\[pP]\{(\w+)\}", pattern[i:])
                if nxt == "P" or m is None or m.group(1) not in _ASCII_CLASSES:
                    return None
                members = _ASCII_CLASSES[m.group(1)]
                out.append(members if depth else (f"[{members}]" if members else "[^\\x00-\\x7f]"))
                i += len(m.group(0))
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not depth:
            depth = 1
        elif c == "]" and depth:
            depth = 0
        out.append(c)
        i += 1
    return "".join(out)


def _state(component: Any) -> Any:
    return None if component is None else json.loads(component.__getstate__())


def _word_pattern(pre: Any) -> Optional[str]:
    """The word regex of a ByteLevel (or Split + ByteLevel) pre-tokenizer without a prefix space; else None."""
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or "Regex" not in (split.get("pattern") or {}) or byte_level.get("type") != "ByteLevel"
            or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space")):
        return None
    return split["pattern"]["Regex"]


def _normalizer_ok(norm: Any) -> bool:
    if norm is None:
        return True
    if norm.get("type") == "Sequence":
        return all(_normalizer_ok(n) for n in norm.get("normalizers", []))
    return norm.get("type") in _UNICODE_FORMS


def _post_ok(post: Any) -> bool:
    """No post-processor that moves offsets without special tokens (ByteLevel's trim_offsets does)."""
    if post is None:
        return True
    if post.get("type") == "Sequence":
        return all(_post_ok(p) for p in post.get("processors", []))
    if post.get("type") == "ByteLevel":
        return not post.get("trim_offsets")
    return post.get("type") in ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def _alternation(tokens: List[str]) -> Optional[Pattern[str]]:
    """One regex matching any of ``tokens``, the longest first at each position (leftmost-longest)."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


class _Ids(dict):  # type: ignore[type-arg]
    """word -> token ids; a missing word is tokenised by the model (``__missing__`` keeps hits in C)."""

    def __init__(self, miss: Any) -> None:
        super().__init__()
        self._miss = miss

    def __missing__(self, word: str) -> Tuple[int, ...]:
        return self._miss(word)


class WordCache:
    """Token ids and offsets of ASCII text from a byte-level BPE tokenizer, words looked up in a dictionary."""

    def __init__(self, backend: Any, words: Pattern[str], special: Optional[Pattern[str]],
                 normal: Optional[Pattern[str]], added: Dict[str, int]) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._model = backend.model
        self._words, self._special, self._normal, self._added = words, special, normal, added
        self._byte_char = bytes_to_unicode()
        self._ids = _Ids(self._miss)  # hits never leave C
        # added tokens that are not ASCII themselves (DeepSeek's <｜User｜>): then each piece is checked instead
        self._unsafe_added = any(_UNSAFE.search(t) for t in added)
        # characters of each token: its byte-level string's length (one byte = one ASCII character)
        vocab = backend.get_vocab(with_added_tokens=True)
        self._token_chars = np.zeros(max(vocab.values(), default=0) + 1, dtype=np.int64)
        for token, i in vocab.items():
            self._token_chars[i] = len(token)
        for token, i in added.items():  # an added token covers its own text
            self._token_chars[i] = len(token)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Optional["WordCache"]:
        """A :class:`WordCache` giving exactly what ``tokenizer``'s Rust pipeline gives, or None where it cannot.

        Args:
            tokenizer: a transformers tokenizer (fast: with a ``backend_tokenizer``).

        Returns:
            The cache, or None: not a byte-level BPE of the shape described in the module docstring,
            or a probe string tokenised differently.
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "split_special_tokens", False):
            return None
        try:
            model = backend.model
            if (type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix
                    or model.end_of_word_suffix or backend.truncation or backend.padding
                    or backend.encode_special_tokens):
                return None
            if not _normalizer_ok(_state(backend.normalizer)) or not _post_ok(_state(backend.post_processor)):
                return None
            pattern = _word_pattern(_state(backend.pre_tokenizer))
            ascii_pattern = _ascii_pattern(pattern) if pattern is not None else None
            if ascii_pattern is None:
                return None
            words = re.compile(ascii_pattern, re.ASCII)
            if words.groups:  # findall would return groups, not words
                return None
            added_tokens = list(backend.get_added_tokens_decoder().items())
            if any(t.lstrip or t.rstrip or t.single_word or not t.content for _, t in added_tokens):
                return None
            if backend.normalizer is not None and any(t.normalized and _UNSAFE.search(t.content)
                                                      for _, t in added_tokens):
                return None  # matched after normalising: a non-ASCII one may change (NFKC's "\ufb01" is "fi")
            added = {t.content: i for i, t in added_tokens}
            cache = cls(backend, words, _alternation([t.content for _, t in added_tokens if not t.normalized]),
                        _alternation([t.content for _, t in added_tokens if t.normalized]), added)
            probes = list(_PROBES) + [f"{p}{t}{p}" for p in _PROBES[:2] for t in list(added)[:8]]
            for text, enc in zip(probes, backend.encode_batch(probes, add_special_tokens=False)):
                got = cache.encode(text)
                if got is None or got[0].tolist() != enc.ids or got[1].tolist() != [list(o) for o in enc.offsets]:
                    return None
        except Exception:  # noqa: BLE001 - anything unexpected in a tokenizer's shape: the Rust path is always right
            return None
        return cache

    def _miss(self, word: str) -> Tuple[int, ...]:
        tokens = self._model.tokenize("".join(self._byte_char[b] for b in word.encode("ascii")))
        ids = self._ids[word] = tuple(t.id for t in tokens)
        return ids

    def _pieces(self, text: str) -> List[Tuple[str, bool]]:
        """``text`` split at the added tokens: (piece, is an added token), the non-normalised ones first."""
        out: List[Tuple[str, bool]] = []
        first = self._special.split(text) if self._special is not None else [text]
        for i, piece in enumerate(first):
            if i % 2:
                out.append((piece, True))
            elif piece:
                if self._normal is None:
                    out.append((piece, False))
                else:
                    out.extend((p, bool(j % 2)) for j, p in enumerate(self._normal.split(piece)) if p)
        return out

    def encode(self, text: str) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Token ids (int32) and character offsets (int64 ``[n, 2]``) of ``text``; None: use the Rust tokenizer.

        None for a text holding, outside its added tokens, a character other than
        printable ASCII, tab, newline or carriage return, or one whose words do not cover it.
        """
        if not self._unsafe_added and _UNSAFE.search(text) is not None:
            return None  # decided before any work: a non-ASCII corpus costs only this search
        if len(self._ids) >= MAX_WORDS:  # bounded memory on a corpus of many distinct words
            self._ids.clear()
        ids: List[int] = []
        get_ids = self._ids.__getitem__
        for piece, is_added in self._pieces(text):
            if is_added:
                ids.append(self._added[piece])
            elif _UNSAFE.search(piece) is not None:
                return None
            else:
                ids.extend(chain.from_iterable(map(get_ids, self._words.findall(piece))))
        ids_a = np.asarray(ids, dtype=np.int64)
        lens = self._token_chars[ids_a]
        ends = np.cumsum(lens)
        if (ends[-1] if len(ends) else 0) != len(text):  # a gap no word matched (or a token of another length)
            return None
        offsets = np.empty((len(ends), 2), dtype=np.int64)
        offsets[:, 1] = ends
        offsets[:, 0] = ends - lens
        return ids_a.astype(np.int32), offsets
