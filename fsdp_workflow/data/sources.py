"""Reading records from the data files, in a stable order, in chunks for the workers.

A *record* is one training example before tokenisation, with where it came
from (file and 1-based line; the row number for Parquet and ``datasets``
sources, the first line of the block for text files). Sources:

- ``text``: ``.txt``/``.md``/``.text`` files, one record per blank-line separated block;
- ``jsonl``: JSON lines (``.jsonl``/``.json``), one record per non-empty line,
  read as bytes and decoded line by line (a line that is not UTF-8, or larger
  than :data:`MAX_RECORD_BYTES`, is a bad record named by its line), parsed by
  the workers;
- ``parquet``: rows of ``.parquet`` files (needs pyarrow);
- ``hf_disk``: a dataset written by ``datasets``' ``save_to_disk`` (the ``train``
  split of a ``DatasetDict``, or its only one).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from fsdp_workflow.config.schema import DataSource

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


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
    return {DataSource.text: TEXT_SUFFIXES, DataSource.jsonl: JSONL_SUFFIXES,
            DataSource.parquet: PARQUET_SUFFIXES}.get(source, ())


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
    with open(f, "rb") as fh:
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
    with open(f, "rb") as fh:
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
