"""The shape of ``verification.json`` (and :attr:`~fsdp_workflow.consolidate.consolidation.ConsolidationResult.verification`).

The report is plain JSON, read back by ``status`` and by people, so it stays a dict at
runtime; these TypedDicts name every key the steps write, so a misspelt key or a wrong
value type is a type error rather than a silently different file.
"""

from __future__ import annotations

from typing import List, TypedDict, Union

from ..deepspeed import DeepSpeedReport
from ..jsontypes import PlainValue


# One written tensor: dtype, shape, the xxh3_128 of its bytes as read back from the file,
# whether it matched the source (None: not every byte compared), which comparison ran
# ("bytes", "rounding", "average"), how many distinct source chunks were compared and the
# fraction of the tensor compared (1.0 unless fast mode sampled it).
TensorEntry = TypedDict("TensorEntry", {
    "dtype": str,
    "shape": List[int],
    "xxh3_128": str,
    "equal_to_source": Union[bool, None],
    "check": str,
    "chunks": int,
    "compared_fraction": float,
})


class ValuesReport(TypedDict):
    """How the values were compared: counts, the comparisons used, and what was not derived independently."""

    compared: int
    mode: str
    bytes_compared_fraction: float
    checks: dict[str, str]
    checksum: str
    chunks: int
    chunks_listed: int
    reader: str
    notes: list[str]


class ArchitectureEntry(TypedDict):
    """The class config.json resolves to, and how it was resolved."""

    name: str | None
    resolves: bool
    notes: list[str]


class KeyReport(TypedDict):
    """The written keys against the architecture's expected state dict."""

    expected: int
    written: int
    missing: list[str]
    unexpected: list[str]
    shape_mismatch: list[str]


class TiedReport(TypedDict):
    """The output embedding dropped because config.json ties it to the input embedding."""

    dropped: str
    kept: str
    identical: bool


class FromPretrainedReport(TypedDict, total=False):
    """The load test: ``ok`` with what transformers complained about, or why it was skipped."""

    ok: bool
    error: str
    skipped: str
    missing_keys: list[str]
    unexpected_keys: list[str]
    mismatched_keys: list[str]
    error_msgs: list[str]


class NonFiniteEntry(TypedDict):
    """NaN and +-inf values counted in one written tensor."""

    nan: int
    inf: int


class NonFiniteReport(TypedDict):
    """The NaN/inf scan of every written byte (:mod:`fsdp_workflow.consolidate.nonfinite`); ``tensors`` is empty unless allowed."""

    scanned: str
    allowed: bool  # non-finite values were written on purpose (--allow-nonfinite)
    tensors: dict[str, NonFiniteEntry]


class _VerificationCore(TypedDict):
    ok: bool
    errors: list[str]
    notes: list[str]
    layout: str
    dtype: str


class VerificationReport(_VerificationCore, total=False):
    """Everything verification.json holds; the optional keys appear when their check ran.

    ``ok``, ``errors``, ``notes``, ``layout`` and ``dtype`` are always present; ``tensors``
    only when verification ran (the CLI's ``verified`` reads that).
    """

    deepspeed: list[DeepSpeedReport]
    meta_pt: dict[str, PlainValue]
    tied_lm_head: TiedReport
    assets_copied: list[str]
    tensors: dict[str, TensorEntry]
    values: ValuesReport
    files: list[str]
    architecture: ArchitectureEntry
    keys: KeyReport
    from_pretrained: FromPretrainedReport
    nonfinite: NonFiniteReport
