"""Tokenising a chunk of records: documents -> token ids and labels (one worker's job).

Each worker holds the tokenizer and the compiled template (:func:`init_worker`)
and turns a chunk into flat arrays (:func:`encode_chunk`). A chunk's result
depends only on the chunk, so any number of workers gives the same arrays.

Character spans become token labels through the fast tokenizer's offsets: a
token carries loss when its characters overlap a trained span, which is what
``transformers``' ``return_assistant_tokens_mask`` marks for a
``{% generation %}`` block (the token holding its first character through the
one holding its last).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from fsdp_workflow.config.schema import ModelConfig, Overlong
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.formats import BadRecord, Document, FormatSpec, parse_json_line, to_document
from fsdp_workflow.data.sources import BadPayload, Chunk
from fsdp_workflow.data.templates import compile_template
from fsdp_workflow.data.wordcache import WordCache


@dataclass(frozen=True)
class EncodeSpec:
    """Everything a worker needs (picklable)."""

    model: ModelConfig  # to load the tokenizer in the worker
    fmt: FormatSpec
    json_lines: bool  # payloads are raw JSON lines
    seq_len: int
    overlong: Overlong


@dataclass
class ChunkResult:
    """One chunk, encoded: documents back to back, plus what was left out."""

    tokens: np.ndarray  # int32, all kept documents concatenated
    labels: np.ndarray  # int32, IGNORE_INDEX where no loss
    lengths: np.ndarray  # int64, one per kept document
    records: int = 0
    path: str = ""  # the file the chunk came from
    lines: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # each kept document's line
    bad: List[Tuple[str, int, str]] = field(default_factory=list)  # (file, line, reason)
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0  # truncation left no trained token


_STATE: Dict[str, Any] = {}
CHARS_PER_TOKEN = 32  # a text longer than this x seq_len is tokenised from a prefix (see _tokenize)


def init_worker(spec: EncodeSpec, tokenizer: Any = None) -> None:
    """Load the tokenizer (unless given) and compile the template, once per process."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    if tokenizer is None:
        from fsdp_workflow.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(spec.model)
    template = compile_template(spec.fmt.template) if spec.fmt.template is not None else None
    variables = template_variables(tokenizer)
    if template is not None and not template.marked:
        template.end_of_turn(tokenizer, **variables)  # once, here: a template without one is refused up front
    _STATE.clear()
    _STATE.update(spec=spec, tokenizer=tokenizer, render=template, variables=variables,
                  words=WordCache.for_tokenizer(tokenizer))


def template_variables(tokenizer: Any) -> Dict[str, Any]:
    """What a template may read besides the messages: the special tokens, as ``apply_chat_template`` passes them."""
    return {k: v for k, v in dict(tokenizer.special_tokens_map).items() if isinstance(v, (str, list))}


def trained_mask(offsets: np.ndarray, spans: List[Tuple[int, int]]) -> np.ndarray:
    """Tokens whose characters overlap any span: exactly what ``return_assistant_tokens_mask`` marks."""
    mask = np.zeros(len(offsets), dtype=bool)
    if len(offsets) == 0:
        return mask
    s, e = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        if b > a:
            mask |= (s < b) & (e > a)  # transformers' rule for return_assistant_tokens_mask
    return mask


def _tokenize(tok: Any, texts: List[str], seq_len: int) -> List[Tuple[List[int], List[Tuple[int, int]]]]:
    """Token ids and character offsets of each text; a long text only as far as ``seq_len`` needs.

    A text longer than :data:`CHARS_PER_TOKEN` x ``seq_len`` characters is tokenised
    from a prefix of that length. When more than ``seq_len`` tokens end in its first
    half, those tokens are what the whole text gives (tokenisers split text into
    words before merging, so a cut changes only the last words) and the document is
    overlong either way: truncated or dropped, never tokenised whole. This is what
    keeps a 50 MB record at a few times its size in memory, not gigabytes of offsets.
    """
    budget = max(CHARS_PER_TOKEN * seq_len, 4096)
    short = [i for i, t in enumerate(texts) if len(t) <= budget]
    out: List[Any] = [None] * len(texts)
    if short:
        enc = tok([texts[i] for i in short], add_special_tokens=False, return_offsets_mapping=True)
        for i, ids, offs in zip(short, enc["input_ids"], enc["offset_mapping"]):
            out[i] = (ids, offs)
    for i, t in enumerate(texts):
        if out[i] is None:
            enc = tok(t[:budget], add_special_tokens=False, return_offsets_mapping=True)
            ids, offs = enc["input_ids"], enc["offset_mapping"]
            if len(ids) <= seq_len + 1 or offs[seq_len + 1][1] > budget // 2:
                enc = tok(t, add_special_tokens=False, return_offsets_mapping=True)  # rare: very long tokens
                ids, offs = enc["input_ids"], enc["offset_mapping"]
            out[i] = (ids, offs)
    return out


def _span_mask(enc: Any, n: int, spans: List[Tuple[int, int]]) -> Optional[np.ndarray]:
    """The overlap rule of :func:`trained_mask`, from a ``tokenizers.Encoding`` without converting its offsets.

    Looks up only the tokens at each span's ends (``char_to_token``), then
    widens over neighbours whose characters still overlap the span (byte
    tokens of one character share its offsets). Returns None where a span end
    lies in no token (a normaliser dropped the character): the caller then
    takes the offsets path.
    """
    mask = np.zeros(n, dtype=bool)
    for a, b in spans:
        if b <= a:
            continue
        first, last = enc.char_to_token(a), enc.char_to_token(b - 1)
        if first is None or last is None:
            return None
        while first > 0 and enc.token_to_chars(first - 1)[1] > a:
            first -= 1
        while last + 1 < n and enc.token_to_chars(last + 1)[0] < b:
            last += 1
        mask[first:last + 1] = True
    return mask


def _fast_encode(tok: Any, texts: List[str], spans: List[List[Tuple[int, int]]],
                 seq_len: int) -> Optional[List[Tuple[np.ndarray, np.ndarray]]]:
    """Token ids and trained masks straight from the Rust tokenizer (None: not a fast tokenizer, or a long text).

    Calling ``backend_tokenizer.encode_batch`` skips transformers' per-token
    Python conversion of ids and offsets, which cost about as much as the
    tokenising itself here (docs/data.md, "Benchmark").
    """
    backend = getattr(tok, "backend_tokenizer", None)
    budget = max(CHARS_PER_TOKEN * seq_len, 4096)
    if backend is None or getattr(tok, "split_special_tokens", False) or any(len(t) > budget for t in texts):
        return None
    out = []
    for text, enc, sp in zip(texts, backend.encode_batch(texts, add_special_tokens=False), spans):
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = _span_mask(enc, len(ids), sp)
        if mask is None:
            mask = trained_mask(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), sp)
        out.append((ids, mask))
    return out


def _encode_docs(tok: Any, docs: List[Document], seq_len: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Token ids and trained masks of ``docs``: the word cache where it applies, the Rust tokenizer for the rest.

    Both give the same ids and offsets (:mod:`fsdp_workflow.data.wordcache`); the
    word cache skips the Rust pre-tokenizer's per-byte bookkeeping, most of the
    tokenising time on ASCII text and much of it on code, CJK and emoji (docs/data.md, "Benchmark").
    """
    out: List[Any] = [None] * len(docs)
    words: Optional[WordCache] = _STATE.get("words")
    if words is not None:
        budget = max(CHARS_PER_TOKEN * seq_len, 4096)  # longer texts: _tokenize's prefix rule
        for i, d in enumerate(docs):
            got = words.encode(d.text) if len(d.text) <= budget else None
            if got is not None:
                out[i] = (got[0], trained_mask(got[1], d.spans))
    rest = [i for i, o in enumerate(out) if o is None]
    if rest:
        texts = [docs[i].text for i in rest]
        fast = _fast_encode(tok, texts, [docs[i].spans for i in rest], seq_len)
        if fast is None:
            fast = [(np.asarray(ids, dtype=np.int32),
                     trained_mask(np.asarray(offs, dtype=np.int64).reshape(-1, 2), docs[i].spans))
                    for i, (ids, offs) in zip(rest, _tokenize(tok, texts, seq_len))]
        for i, pair in zip(rest, fast):
            out[i] = pair
    return out


def encode_chunk(chunk: Chunk) -> ChunkResult:
    """Tokenise and label one chunk of records (in the worker set up by :func:`init_worker`).

    A record that cannot be used is listed in the result's ``bad`` with its file and line, never raised.
    """
    spec: EncodeSpec = _STATE["spec"]
    tok = _STATE["tokenizer"]
    path, rows = chunk
    docs: List[Document] = []
    result = ChunkResult(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64), records=len(rows),
                         path=path)
    doc_lines: List[int] = []
    for line, payload in rows:
        if isinstance(payload, BadPayload):
            result.bad.append((path, line, payload.reason))
            continue
        try:
            record = parse_json_line(payload) if spec.json_lines else payload
            docs.append(to_document(record, spec.fmt, _STATE["render"], _STATE["variables"]))
            doc_lines.append(line)
        except BadRecord as err:
            result.bad.append((path, line, str(err)))
    if not docs:
        return result
    fast = _encode_docs(tok, docs, spec.seq_len)
    eos = tok.eos_token_id
    toks: List[np.ndarray] = []
    labs: List[np.ndarray] = []
    lengths: List[int] = []
    kept_lines: List[int] = []
    for d, line, (ids_a, mask) in zip(docs, doc_lines, fast):
        if d.eos:
            ids_a = np.append(ids_a, np.int32(eos))
            mask = np.append(mask, d.eos_trained)
        if len(ids_a) == 0:
            continue  # an empty text without EOS: nothing to train or pack
        if len(ids_a) > spec.seq_len:
            if spec.overlong == Overlong.drop:
                result.dropped_overlong += 1
                continue
            result.truncated += 1
            ids_a, mask = ids_a[: spec.seq_len], mask[: spec.seq_len]
            if not mask[1:].any():
                result.dropped_untrained += 1
                continue
        toks.append(ids_a)
        labs.append(np.where(mask, ids_a, IGNORE_INDEX).astype(np.int32))
        lengths.append(len(ids_a))
        kept_lines.append(line)
    if toks:
        result.lines = np.asarray(kept_lines, dtype=np.int64)
        result.tokens = np.concatenate(toks)
        result.labels = np.concatenate(labs)
        result.lengths = np.asarray(lengths, dtype=np.int64)
    return result
