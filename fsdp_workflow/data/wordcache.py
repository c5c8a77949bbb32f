"""Byte-level BPE with a word cache: the same ids and offsets as the Rust tokenizer, about 2-3x faster.

Most of a byte-level BPE tokenizer's time (GPT-2, Llama 3, Qwen2 style) goes to
pre-tokenising, not to the merges: the Rust pipeline splits the text into
words with a regex and then builds, for every byte of every word, the
alignment tables that its offsets come from. :class:`WordCache` does the same
steps with a Python regex engine and a dictionary from each word to its token
ids, calling the tokenizer's own BPE model only for a word not seen before:

1. split the text at the added tokens (leftmost-longest, the non-normalised
   ones first, as ``tokenizers``' ``AddedVocabulary`` does);
2. split each piece into words with the pre-tokenizer's own regex: a piece of
   printable ASCII (plus tab, newline, carriage return) with Python's ``re`` and
   ASCII classes for ``\\p{L}``, ``\\p{N}``, ...; any other piece with ``regex``
   (Unicode classes, as Oniguruma's), once each of its characters is known to
   fall in the same classes in both engines (:meth:`WordCache._verify` asks
   the Rust tokenizer's own engine, once per character) and the piece is in
   the normaliser's Unicode forms already (so the normaliser changes nothing);
3. look each word up (on a miss: the model's ``tokenize`` on its byte-level form);
4. offsets from the tokens' byte lengths: a token holding part of a character
   covers the whole character, as the Rust offsets do.

It is used only where it provably gives what ``backend_tokenizer.encode``
gives: :meth:`WordCache.for_tokenizer` accepts a tokenizer only when its
pipeline has exactly this shape (no normaliser but Unicode forms; a ByteLevel
or Split+ByteLevel pre-tokenizer without a prefix space; a BPE model without
dropout or affixes; added tokens without strip flags; no truncation, no offset
trimming) and a probe set of awkward strings, ASCII and not, gives equal ids
and offsets both ways. :meth:`WordCache.encode` returns None for text it
cannot be sure of (a character the engines class differently, one that a
case-insensitive group may fold, a lone surrogate, text the normaliser would
change, words that do not cover the text), and the caller tokenises that text
with the Rust tokenizer. ``tests/data/test_wordcache.py`` checks both paths
give the same tokens, offsets and masks on every family of
``tests/data/test_families.py``, on CJK, emoji, combining marks and code, and
on random strings of code points from all of Unicode.
"""

from __future__ import annotations

import json
import operator
import re
import unicodedata
from itertools import chain
from typing import Any, Dict, FrozenSet, List, Optional, Pattern, Set, Tuple

import numpy as np
import regex

# GPT-2's pre-tokenizer regex (tokenizers' ByteLevel with use_regex=True)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_TOKEN_ID = operator.attrgetter("id")
MAX_WORDS = 200_000  # cache entries per process (about 50 MB); past this, the cache starts again
_UNSAFE = re.compile(r"[^\t\n\r\x20-\x7e]")  # a character this path does not handle: the Rust tokenizer does
# Unicode classes -> their ASCII members (the only characters this path sees)
_ASCII_CLASSES = {"L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "N": "0-9", "Nd": "0-9",
                  "Lt": "", "Lm": "", "Lo": "", "M": "", "Mn": "", "Mc": "", "Me": "", "Nl": "", "No": ""}
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_ESCAPES = "pPsSrntdDwW"  # escapes that mean the same to Oniguruma and to re.ASCII on the characters seen here
# class atoms of a pattern: each is checked, character by character, against the Rust tokenizer's own regex engine
_ATOMS = re.compile(r"\\[pP]\{\w+\}|\\[sSdDwW]")
_PROBES = ("Hello, world! It's 42.", "we'll  see\n\n\tthe END'S   \r\nof 1234567 and x2y3", "  lead\nand trail  ",
           "a\r\n\r\nb", "don't!!! ?? ...  ;; (x) [y] {z}", "MiXeD CaSe'LL 'VE 12ab34", "\t\t", " ", "x")
# text the Unicode path serves (or refuses, never differs on): accents, CJK without spaces, emoji sequences, combining
# marks, other scripts and digits, full-width forms, control characters, case folds (ß, ſ, the Kelvin sign)
_UNICODE_PROBES = ("naïve café, Grüße — “quoted” → 3½ ±0.5°C", "分布式训练：梯度同步，参数切分。你好！\n\n２０２６年",
                   "東京は晴れ。ひらがなカタカナ漢字、コードを直す", " 👩\u200d💻🇯🇵 👍🏽❤️ 🚀🚀 ok🎉", "e\u0301 a\u0308\u0301 ﬁx",
                   "Привет, мир! Γειά σου 안녕하세요 مرحبا १२३", "def größe(città='值'):  # ✓ λ\n\treturn f\"{città} 🔥\"",
                   "x\x0by\x0cz\x1c\x85\u2028\u3000end", "DON'ſ it'K Straße 'ß", "\u00a0 \u2009x\u00a0\n")


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


def _case_insensitive_groups(pattern: str) -> List[str]:
    """Each ``(?i:...)`` group of ``pattern``, as a pattern of its own."""
    groups = []
    for start in (m.start() for m in re.finditer(r"\(\?i:", pattern)):
        depth, i = 0, start
        while i < len(pattern):
            if pattern[i] == "\\":
                i += 2
                continue
            depth += {"(": 1, ")": -1}.get(pattern[i], 0)
            if depth == 0:
                groups.append(pattern[start:i + 1])
                break
            i += 1
    return groups


def _matched(pattern: str, text: str) -> Tuple[Set[int], Set[int]]:
    """The positions of ``text`` inside a match of ``pattern``: by Oniguruma (as the Rust tokenizer), by ``regex``."""
    from tokenizers import Regex, pre_tokenizers

    outside = pre_tokenizers.Split(Regex(pattern), behavior="removed").pre_tokenize_str(text)
    rust = set(range(len(text))) - {i for _, (a, b) in outside for i in range(a, b)}
    python = {i for m in regex.finditer(pattern, text) for i in range(*m.span())}
    return rust, python


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


def _forms(norm: Any) -> Tuple[str, ...]:
    """The Unicode forms a normaliser accepted by :func:`_normalizer_ok` applies, in order."""
    if norm is None:
        return ()
    if norm.get("type") == "Sequence":
        return tuple(f for n in norm.get("normalizers", []) for f in _forms(n))
    return (norm["type"],)


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
    """Token ids and offsets from a byte-level BPE tokenizer, words looked up in a dictionary."""

    def __init__(self, backend: Any, pattern: str, words: Pattern[str], special: Optional[Pattern[str]],
                 normal: Optional[Pattern[str]], added: Dict[str, int], forms: Tuple[str, ...] = ()) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._model = backend.model
        self._normalizer = backend.normalizer
        self._words, self._special, self._normal, self._added = words, special, normal, added
        self._atoms = sorted({a.group(0) for a in _ATOMS.finditer(pattern)})
        try:  # the pre-tokenizer's own pattern, Unicode classes and all
            self._unicode_words = regex.compile(pattern)
        except regex.error:
            self._unicode_words = None
        # served on ASCII text only: a pattern Python's regex cannot read, or case-insensitive as a whole
        self._unicode = self._unicode_words is not None and "(?i)" not in pattern
        self._folds = _case_insensitive_groups(pattern)
        self._forms = forms  # the Unicode forms the normaliser applies: a piece must be in each already
        self._good: Set[str] = set()  # characters whose classes both regex engines agree on
        self._bad: Set[str] = set()  # characters they do not (or that may fold or normalise): Rust tokenizer
        byte_char = bytes_to_unicode()
        self._to_byte_level = str.maketrans({chr(b): c for b, c in byte_char.items()})
        self._ids = _Ids(self._miss)  # hits never leave C
        # added tokens that are not ASCII themselves (DeepSeek's <｜User｜>): then each piece is checked instead
        self._unsafe_added = any(_UNSAFE.search(t) for t in added)
        # bytes of each token: its byte-level string's length (one character per byte); an added token, its UTF-8
        vocab = backend.get_vocab(with_added_tokens=True)
        self._token_bytes = np.zeros(max(vocab.values(), default=0) + 1, dtype=np.int64)
        for token, i in vocab.items():
            self._token_bytes[i] = len(token)
        for token, i in added.items():  # an added token covers its own text
            self._token_bytes[i] = len(token.encode("utf-8"))

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
            norm = _state(backend.normalizer)
            if not _normalizer_ok(norm) or not _post_ok(_state(backend.post_processor)):
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
            cache = cls(backend, pattern, words,
                        _alternation([t.content for _, t in added_tokens if not t.normalized]),
                        _alternation([t.content for _, t in added_tokens if t.normalized]), added, _forms(norm))
            probes = list(_PROBES) + [f"{p}{t}{p}" for p in _PROBES[:2] for t in list(added)[:8]]
            unicode_probes = list(_UNICODE_PROBES) + [f"{p}{t}{p}" for p in _UNICODE_PROBES[:2]
                                                      for t in list(added)[:8]]
            for text, enc in zip(probes + unicode_probes,
                                 backend.encode_batch(probes + unicode_probes, add_special_tokens=False)):
                got = cache.encode(text)
                if got is None and text in unicode_probes:
                    continue  # refused is allowed there: the Rust tokenizer takes it
                if got is None or got[0].tolist() != enc.ids or got[1].tolist() != [list(o) for o in enc.offsets]:
                    return None
        except Exception:  # noqa: BLE001 - anything unexpected in a tokenizer's shape: the Rust path is always right
            return None
        return cache

    def _miss(self, word: str) -> Tuple[int, ...]:
        tokens = self._model.tokenize(word.encode("utf-8").decode("latin-1").translate(self._to_byte_level))
        ids = self._ids[word] = tuple(map(_TOKEN_ID, tokens))
        return ids

    def _verify(self, chars: FrozenSet[str]) -> None:
        """Sort ``chars`` (not seen before) into good and bad, asking the Rust tokenizer's own regex engine.

        A character is good when Oniguruma (the Rust pre-tokenizer's engine) and Python's
        ``regex`` agree on its membership in every class the pattern names (``\\p{L}``,
        ``\\s``, ...): then both engines split any text of good characters into the same
        words, as the pattern is the same. Bad besides: a lone surrogate (no UTF-8); with
        a case-insensitive group, one either engine folds to an ASCII letter (``ſ``, ``K``,
        ``İ``) or matches inside that group after an apostrophe; with a normaliser, one it
        changes on its own.
        """
        bad = {c for c in chars if 0xD800 <= ord(c) <= 0xDFFF}
        probe = "".join(sorted(chars - bad))  # each character once: position i is probe[i]
        for atom in self._atoms + (["(?i:[a-z])"] if self._folds else []):
            rust, python = _matched(atom, probe)
            bad |= {probe[i] for i in rust ^ python}
            if atom == "(?i:[a-z])":
                bad |= {probe[i] for i in rust | python if not probe[i].isascii()}
        if self._folds:
            probe = "".join(f"'{c}{c} " for c in sorted(chars - bad))
            for group in self._folds:
                rust, python = _matched(group, probe)
                bad |= {probe[i] for i in rust | python if not probe[i].isascii()}
        if self._normalizer is not None:
            bad |= {c for c in chars - bad if self._normalizer.normalize_str(c) != c}
        self._bad |= bad
        self._good |= chars - bad

    def _unicode_ok(self, piece: str) -> bool:
        """Whether the Unicode path gives the Rust tokenizer's words for ``piece`` (a text between added tokens)."""
        chars = frozenset(piece)
        if not chars <= self._good:
            if not chars.isdisjoint(self._bad):
                return False
            self._verify(chars - self._good)
            if not chars.isdisjoint(self._bad):
                return False
        # the normaliser leaves a piece alone that is in its forms already, so offsets need no alignment
        return all(unicodedata.is_normalized(form, piece) for form in self._forms)

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

        Text that is printable ASCII, tab, newline or carriage return outside its added
        tokens is split with Python's ``re`` and the pattern's ASCII classes; any other
        piece with Python's ``regex`` and the pattern itself, once its characters are
        known to split the same in both engines (:meth:`_verify`) and it is in the
        normaliser's forms already. None for a piece that is not, or words that do not cover the text.
        """
        if len(self._ids) >= MAX_WORDS:  # bounded memory on a corpus of many distinct words
            self._ids.clear()
        ids: List[int] = []
        get_ids = self._ids.__getitem__
        plain = not self._unsafe_added and _UNSAFE.search(text) is None  # decided once for the usual text
        for piece, is_added in self._pieces(text):
            if is_added:
                ids.append(self._added[piece])
            elif plain or _UNSAFE.search(piece) is None:
                ids.extend(chain.from_iterable(map(get_ids, self._words.findall(piece))))
            elif self._unicode and self._unicode_ok(piece):
                ids.extend(chain.from_iterable(map(get_ids, self._unicode_words.findall(piece))))
            else:
                return None
        ids_a = np.asarray(ids, dtype=np.int64)
        lens = self._token_bytes[ids_a]
        ends = np.cumsum(lens)
        if text.isascii():  # one byte per character
            chars, n_bytes = None, len(text)
        else:
            encoded = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            chars = np.cumsum((encoded & 0xC0) != 0x80) - 1  # the character each byte belongs to
            n_bytes = len(encoded)
        if (ends[-1] if len(ends) else 0) != n_bytes:  # a gap no word matched (or a token of another length)
            return None
        offsets = np.empty((len(ends), 2), dtype=np.int64)
        if chars is None:
            offsets[:, 1] = ends
            offsets[:, 0] = ends - lens
        elif len(ends):  # a token holding part of a character covers all of it, as the Rust offsets do
            offsets[:, 0] = chars[ends - lens]
            offsets[:, 1] = chars[ends - 1] + 1
        return ids_a.astype(np.int32), offsets
