"""Reading records from the data files, in a stable order, in chunks for the workers.

A *record* is one training example before tokenisation, with where it came
from (file and 1-based line; the row number for Parquet and ``datasets``
sources, the first line of the block for text files). Sources:

- ``text``: ``.txt``/``.md``/``.text`` files, one record per blank-line separated block;
- ``jsonl``: JSON lines (``.jsonl``/``.json``), one record per non-empty line,
  read as bytes and decoded line by line (a line that is not UTF-8, or larger
  than :data:`MAX_RECORD_BYTES`, is a bad record named by its line), parsed by
  the workers; or one JSON array (Alpaca's ``alpaca_data.json``, ShareGPT dumps),
  one record per element, named by its 1-based index;
- ``parquet``: rows of ``.parquet`` files (needs pyarrow);
- ``hf_disk``: a dataset written by ``datasets``' ``save_to_disk`` (the ``train``
  split of a ``DatasetDict``, or its only one).

Text and JSON files may be gzip- or zstd-compressed (recognised by their magic
bytes, whatever their name; ``.gz``/``.zst`` names are found in directories and
globs) and are read as streams. A file that is really Parquet or Arrow, or text
in UTF-16/UTF-32 (its byte-order mark), is named with the fix, never read as
garbage with latin1 advice.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator, List, Optional, Sequence, Tuple

from fsdp_workflow.config.schema import DataSource

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".zst")  # read as streams (recognised by their magic bytes, not by name)
_GZIP, _ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
# Byte-order marks of the encodings we refuse by name (UTF-32 first: its LE mark starts with UTF-16's).
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"),
              (b"\xfe\xff", "UTF-16BE"))
# Binary formats a text or JSON source may be handed by mistake.
_FOREIGN = ((b"PAR1", "a Parquet file", "data.source=parquet"),
            (b"ARROW1", "an Arrow IPC file", "data.source=hf_disk on its save_to_disk directory, or convert it to "
                                             "Parquet and use data.source=parquet"))


# The largest record read (a JSON line, a text block), in bytes. A larger one is a bad
# record (named by file:line; data.on_bad_record=skip leaves it out) and is skipped
# without being held in memory. docs/data.md ("Limits") documents it.
MAX_RECORD_BYTES = 64 << 20
CHUNK_BYTES = 32 << 20  # a chunk handed to a worker holds at most about this much text
_BOM = b"\xef\xbb\xbf"


class DataError(ValueError):
    """The data (or the data config) is unusable; the message names the file, line and fix."""


@dataclass(frozen=True)
class BadPayload:
    """A record the reader could not even hand over (not UTF-8, too large); the worker lists it as bad."""

    reason: str
    lines_in: int = 0  # the bad byte lies this many lines below the record's first line (a text block)


# A chunk: (file, [(line, payload)]). The payload is a text block (text), a raw
# JSON line (jsonl) or a dict (parquet, hf_disk).
Chunk = Tuple[str, List[Tuple[int, Any]]]


@dataclass(frozen=True)
class SourceFile:
    """One input file as the cache key sees it."""

    path: str  # absolute
    size: int
    mtime_ns: int


def suffixes(source: DataSource) -> Sequence[str]:
    plain = {DataSource.text: TEXT_SUFFIXES, DataSource.jsonl: JSONL_SUFFIXES,
             DataSource.parquet: PARQUET_SUFFIXES}.get(source, ())
    if source in (DataSource.text, DataSource.jsonl):
        return (*plain, *(s + c for s in plain for c in COMPRESSED_SUFFIXES))
    return plain


def open_records(f: str) -> BinaryIO:
    """``f`` as a binary stream: decompressed if gzip or zstd (by magic bytes), else as it is.

    Raises:
        DataError: zstd without the zstandard package; a Parquet/Arrow file; UTF-16/UTF-32 text.
    """
    with open(f, "rb") as fh:
        magic = fh.read(4)
    if magic.startswith(_GZIP):
        stream: BinaryIO = gzip.open(f, "rb")  # type: ignore[assignment]
    elif magic.startswith(_ZSTD):
        try:
            import zstandard
        except ImportError as e:
            raise DataError(f"{f}: zstd-compressed; reading it needs the zstandard package "
                            "(pip install zstandard), or decompress it: zstd -d FILE") from e
        stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(f, "rb"), closefd=True))
    else:
        stream = open(f, "rb")
    head = stream.peek(8)[:8]  # type: ignore[attr-defined]
    for bom, name in _WIDE_BOMS:
        if head.startswith(bom):
            stream.close()
            raise DataError(f"{f}: the text is {name} (its byte-order mark says so); records are read as UTF-8. "
                            f"Re-encode it: iconv -f {name} -t UTF-8 FILE > FILE.utf8")
    for magic_bytes, what, fix in _FOREIGN:
        if head.startswith(magic_bytes):
            stream.close()
            raise DataError(f"{f}: this is {what}, not text or JSON lines. Fix: {fix}")
    return stream


def expand(source: DataSource, path: Optional[str], key: str) -> List[str]:
    """The files ``path`` names (a file, a directory searched recursively, or a glob), sorted.

    Raises:
        DataError: ``path`` is unset or matches nothing.
    """
    if source == DataSource.hf_disk:
        if not path or not os.path.isdir(path):
            raise DataError(f"{key}={path!r} is not a directory written by datasets' save_to_disk. "
                            f"Fix {key}.")
        return [os.path.abspath(path)]
    sfx = tuple(suffixes(source))
    if not path:
        raise DataError(f"{key} is not set: give a file, directory or glob of {'/'.join(sfx)} files.")
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if f.endswith(sfx))
    else:
        files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else ([path] if os.path.isfile(path) else [])
    if not files:
        raise DataError(f"{key}={path!r} matches no {'/'.join(sfx)} file. Fix the path (file, directory or glob).")
    return [os.path.abspath(f) for f in files]


def describe_files(source: DataSource, files: Sequence[str]) -> List[SourceFile]:
    """Path, size and modification time of each file (for a ``datasets`` directory: of every file in it)."""
    out: List[SourceFile] = []
    for f in files:
        if os.path.isdir(f):
            for sub in sorted(glob.glob(os.path.join(f, "**", "*"), recursive=True)):
                if os.path.isfile(sub):
                    st = os.stat(sub)
                    out.append(SourceFile(os.path.abspath(sub), st.st_size, st.st_mtime_ns))
        else:
            st = os.stat(f)
            out.append(SourceFile(f, st.st_size, st.st_mtime_ns))
    return out


def _decode(raw: bytes) -> Any:
    """``raw`` as text, or a :class:`BadPayload` saying where it is not UTF-8 (the column within its line)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        return BadPayload(f"not UTF-8: byte 0x{raw[err.start]:02x} at column {column} ({err.reason}). "
                          "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                          lines_in=raw.count(b"\n", 0, err.start))


def _too_large(size: int) -> BadPayload:
    return BadPayload(f"the record is {size / 2**20:.1f} MiB, over the {MAX_RECORD_BYTES / 2**20:g} MiB limit on "
                      "one record (docs/data.md, Limits). Split it, or leave it out")


def _text_blocks(f: str) -> Iterator[Tuple[int, Any]]:
    """Blank-line separated blocks of a text file, stripped, with the line each starts on (bytes decoded per block)."""
    with open_records(f) as fh:
        data = fh.read()
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    line = 1
    for block in data.split(b"\n\n"):
        stripped = block.strip()
        if stripped:
            lead = block[: len(block) - len(block.lstrip())]
            at = line + lead.count(b"\n")
            payload = _too_large(len(stripped)) if len(stripped) > MAX_RECORD_BYTES else _decode(stripped)
            # a bad byte is named by its own line (file:LINE), not by the line its block starts on
            yield at + (payload.lines_in if isinstance(payload, BadPayload) else 0), payload
        line += block.count(b"\n") + 2


def _json_lines(f: str) -> Iterator[Tuple[int, Any]]:
    """Non-empty lines of a JSON-lines file, read as bytes and decoded one by one.

    A line over :data:`MAX_RECORD_BYTES` is skipped in pieces (never held whole) and
    reported as a :class:`BadPayload`, as is one that is not UTF-8.
    """
    limit = MAX_RECORD_BYTES
    with open_records(f) as fh:
        if fh.peek(4096)[:4096].lstrip(_BOM + b" \t\r\n").startswith(b"["):  # type: ignore[attr-defined]
            yield from _json_array(f, fh.read())
            return
        n = 0
        while True:
            raw = fh.readline(limit + 1)
            if not raw:
                return
            n += 1
            if n == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if len(raw) > limit and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):
                    raw = fh.readline(1 << 20)
                    size += len(raw)
                yield n, _too_large(size)
                continue
            if raw.strip():
                yield n, _decode(raw)


def _json_array(f: str, raw: bytes) -> Iterator[Tuple[int, Any]]:
    """The elements of a file holding one JSON array, each as a JSON text (what the workers parse), by index."""
    text = _decode(raw[len(_BOM):] if raw.startswith(_BOM) else raw)
    if isinstance(text, BadPayload):
        yield 1, text
        return
    try:
        records = json.loads(text)
    except ValueError as err:
        line = text.count("\n", 0, getattr(err, "pos", 0)) + 1
        raise DataError(f"{f}:{line}: the file starts as a JSON array but is not valid JSON ({err}). "
                        "Fix the file, or write one JSON object per line (JSON Lines)") from None
    if not isinstance(records, list):
        raise DataError(f"{f}: holds one JSON value, not an array of records or JSON Lines")
    for i, record in enumerate(records, 1):
        yield i, json.dumps(record, ensure_ascii=False)


def count_file(source: DataSource, f: str) -> int:
    """The records prepare reads from ``f`` (text or jsonl), counted the way it reads them.

    Raises:
        DataError, OSError: as reading it would (prepare names the problem).
    """
    with open_records(f) as fh:
        data = fh.read()
    if source == DataSource.jsonl and data.lstrip(_BOM + b" \t\r\n").startswith(b"["):
        return sum(1 for _ in _json_array(f, data))
    sep = b"\n" if source == DataSource.jsonl else b"\n\n"
    return sum(1 for piece in data.split(sep) if piece.strip())


def payload_bytes(payload: Any) -> int:
    """About how much memory a payload holds (text only; parsed rows count as nothing)."""
    return len(payload) if isinstance(payload, str) else 0


def _rows(source: DataSource, f: str, key: str) -> Iterator[Tuple[int, Any]]:
    if source == DataSource.text:
        yield from _text_blocks(f)
    elif source == DataSource.jsonl:
        yield from _json_lines(f)
    elif source == DataSource.parquet:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError("data.source=parquet needs pyarrow: pip install pyarrow") from e
        pf = pq.ParquetFile(f)
        n = 0
        for batch in pf.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield n, row
    elif source == DataSource.hf_disk:
        try:
            from datasets import load_from_disk
        except ImportError as e:
            raise DataError("data.source=hf_disk needs the datasets package: pip install datasets") from e
        ds = load_from_disk(f)
        if hasattr(ds, "keys"):  # a DatasetDict: take "train" (or the only split)
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        for start in range(0, len(ds), 4096):
            batch = ds[start:start + 4096]
            cols = list(batch)
            for j in range(len(batch[cols[0]]) if cols else 0):
                yield start + j + 1, {c: batch[c][j] for c in cols}
    else:
        raise DataError(f"{key}: data.source={source.value} has no files to read")


def iter_chunks(source: DataSource, files: Sequence[str], key: str, chunk_records: int) -> Iterator[Chunk]:
    """Records of ``files`` in order, ``chunk_records`` (or :data:`CHUNK_BYTES` of text) at a time.

    A chunk never spans two files.
    """
    for f in files:
        rows: List[Tuple[int, Any]] = []
        size = 0
        for row in _rows(source, f, key):
            rows.append(row)
            size += payload_bytes(row[1])
            if len(rows) >= chunk_records or size >= CHUNK_BYTES:
                yield f, rows
                rows, size = [], 0
        if rows:
            yield f, rows
