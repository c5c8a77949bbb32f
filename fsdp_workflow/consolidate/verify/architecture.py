"""The architecture check: the written keys and shapes against the class config.json names, and loading it.

:class:`ArchitectureCheck` runs in a background thread while the copy runs. For Llama,
Mistral and Qwen2 causal LMs the expected keys come from config.json alone
(:mod:`.architecture_rules`, milliseconds, no torch); anything else, or any config the rules are
unsure of, is instantiated with transformers on the meta device, which costs seconds of
imports and is therefore cached.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Literal

from fsdp_workflow.core.rundir import atomic_write_text

from ..hf_assets import needs_arch_from_model_type
from ..hub_layout import layout_for
from ..saved_names import saved_names
from .architecture_rules import ArchResult, expected_from_rules
from .report_schema import FromPretrainedReport, KeyReport, VerificationReport

__all__ = ["ArchResult", "ArchitectureCheck", "cached_expected", "compare_keys", "from_pretrained_check",
           "record_architecture", "record_loading"]


def _expected_from_config(reference: Path, archs: list[str]) -> ArchResult:
    import torch
    import transformers
    from transformers import AutoConfig

    res = ArchResult()
    config = AutoConfig.from_pretrained(str(reference))
    name = archs[0] if archs else None
    if needs_arch_from_model_type(archs):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        res.notes.append(f"architectures {archs} name a wrapper; resolved '{name}' from model_type '{config.model_type}'")
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        res.error = (f"architecture '{name}' (config.json 'architectures') does not resolve to a class in transformers "
                     f"{transformers.__version__}; fix 'architectures' in the reference config.json")
        res.architecture = name
        return res
    res.architecture = name
    with torch.device("meta"):
        model = cls(config)
    state = model.state_dict()
    res.expected = {k: tuple(v.shape) for k, v in state.items()}
    _expect_saved_layout(res, model, state, config.model_type)
    groups: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(pname)
    for names in groups.values():
        res.optional.update(names[1:])
    if getattr(config, "tie_word_embeddings", False):
        out_emb = model.get_output_embeddings()
        if out_emb is not None:
            for pname, p in model.named_parameters(remove_duplicate=False):
                if p is out_emb.weight:
                    res.optional.add(pname)
    return res


def _expect_saved_layout(res: ArchResult, model: object, state: dict, model_type: str) -> None:
    """Where transformers saves other names than it holds (fused MoE experts), expect what the consolidator writes.

    For a ``model_type`` in the consolidator's table (:mod:`..hub_layout`), or one whose
    conversion only renames (:mod:`..saved_names`), that is the layout ``save_pretrained``
    writes, taken here from transformers' own reverse conversion (``revert_weight_conversion``,
    on the meta device, over the whole model): an independent check of the table and of the
    per-key renaming at every consolidation. For any other the in-memory names are written and
    expected, and a note says transformers would save them otherwise.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions saves what it holds
        return
    saved = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(state)).items()}
    if saved == res.expected:
        return
    if layout_for({"model_type": model_type}) is not None or saved_names(model_type) is not None:
        res.expected = saved
        res.notes.append(f"model_type '{model_type}': expected the names and shapes save_pretrained writes "
                         "(transformers' revert_weight_conversion), as the consolidator writes them")
    else:
        res.notes.append(f"model_type '{model_type}': transformers saves {len(saved)} tensors under other names than "
                         f"the {len(res.expected)} it holds; the consolidator has no rule for it "
                         "(fsdp_workflow/consolidate/hub_layout.py) and writes the names held in memory")


def _cache_path(reference: Path, archs: list[str]) -> Path | None:
    """Cache file for this config + transformers/torch versions, or None when disabled."""
    if os.environ.get("FSDP_WORKFLOW_NO_CACHE"):
        return None
    import hashlib
    import importlib.metadata  # here: the copy path (--no-verify) never needs these imports

    try:
        versions = f"{importlib.metadata.version('transformers')}|{importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        return None
    key = hashlib.sha256((reference / "config.json").read_bytes() + json.dumps(archs).encode() + versions.encode()
                         + _CACHE_FORMAT).hexdigest()
    root = Path(os.environ.get("FSDP_WORKFLOW_CACHE") or Path.home() / ".cache" / "fsdp_workflow")
    return root / "arch" / f"{key[:32]}.json"


def cached_expected(reference: Path, archs: list[str]) -> ArchResult:
    """Expected keys: from :mod:`.architecture_rules` when sure, else :func:`_expected_from_config`.

    Instantiating the architecture costs seconds of imports; every checkpoint of a run
    shares one config, so that answer is remembered per (config.json, transformers, torch).
    """
    config = json.loads((reference / "config.json").read_text())
    ruled, unsure = expected_from_rules(config, archs, needs_arch_from_model_type(archs)) if isinstance(config, dict) else (None, "config.json is not an object")
    if ruled is not None:
        return ruled
    path = _cache_path(reference, archs)
    if path is not None and path.is_file():
        try:
            d = json.loads(path.read_text())
            return ArchResult(d["architecture"], {k: tuple(v) for k, v in d["expected"].items()}, set(d["optional"]),
                              None, d["notes"] + ["expected keys taken from the architecture cache"])
        except (ValueError, KeyError):
            pass
    res = _expected_from_config(reference, archs)
    res.notes.append(f"config rules unsure ({unsure}); instantiated with transformers on the meta device")
    if path is not None and res.error is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"architecture": res.architecture, "expected": res.expected,
                                            "optional": sorted(res.optional), "notes": res.notes}))
    return res


_CACHE_FORMAT = b"|saved-layout|saved-names"  # cached answers before: fused experts, then in-memory renamed names


class ArchitectureCheck(threading.Thread):
    """Compute expected keys/shapes in the background; ``result()`` joins."""

    def __init__(self, reference: Path, archs: list[str]) -> None:
        super().__init__(daemon=True, name="arch-check")
        self.reference = reference
        self.archs = archs
        self._result = ArchResult()

    def run(self) -> None:
        try:
            self._result = cached_expected(self.reference, self.archs)
        except Exception as exc:  # noqa: BLE001 - reported in verification.json
            self._result = ArchResult(error=f"cannot instantiate the architecture from {self.reference / 'config.json'}: {type(exc).__name__}: {exc}")

    def result(self) -> ArchResult:
        self.join()
        return self._result


def compare_keys(arch: ArchResult, written: dict[str, tuple[int, ...]]) -> KeyReport:
    """Missing / unexpected / shape-mismatched keys of the output against the architecture.

    Args:
        arch: The expected keys and shapes (and the tied aliases that may be absent).
        written: Name -> shape of every tensor written.

    Returns:
        Counts and the offending keys; all three lists empty when the output matches.
    """
    missing = sorted(k for k in arch.expected if k not in written and k not in arch.optional)
    unexpected = sorted(k for k in written if k not in arch.expected)
    mismatched = sorted(
        f"{k}: checkpoint {list(written[k])} vs config {list(arch.expected[k])}"
        for k in written if k in arch.expected and tuple(written[k]) != tuple(arch.expected[k])
    )
    return {"expected": len(arch.expected), "written": len(written), "missing": missing,
            "unexpected": unexpected, "shape_mismatch": mismatched}


def from_pretrained_check(out_dir: Path, architecture: str) -> FromPretrainedReport:
    """Load the output with transformers and report what it said about the keys.

    Args:
        out_dir: The written model directory (config.json included).
        architecture: The transformers class to load it with.

    Returns:
        ``ok`` and, when not, the exception or transformers' lists of problem keys.
    """
    import transformers

    cls = getattr(transformers, architecture)
    try:
        model, info = cls.from_pretrained(str(out_dir), output_loading_info=True, dtype="auto")
    except Exception as exc:  # noqa: BLE001 - reported
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    del model
    report: FromPretrainedReport = {"ok": True}
    for key in _LOADING_PROBLEMS:
        found = info.get(key)
        if found:
            report[key] = [str(x) for x in found]
            report["ok"] = False
    return report


def record_architecture(report: VerificationReport, arch: ArchResult | None, written: dict[str, tuple[int, ...]]) -> bool:
    """Record the architecture check in ``report`` (``architecture``, ``keys``, ``errors``).

    Args:
        report: verification.json's content, filled in place.
        arch: The expected keys (:class:`ArchitectureCheck`'s result); None when the check did not run.
        written: Name -> shape of every tensor written.

    Returns:
        True when the keys and shapes match config.json's class, so loading the model is worth trying.
    """
    if arch is None:
        return False
    report["architecture"] = {"name": arch.architecture, "resolves": arch.error is None, "notes": arch.notes}
    if arch.error:
        report["errors"].append(arch.error)
        return False
    keys = compare_keys(arch, written)
    report["keys"] = keys
    if keys["missing"] or keys["unexpected"] or keys["shape_mismatch"]:
        report["errors"].append(
            "the checkpoint does not match the architecture in config.json: "
            f"missing {keys['missing'][:5]}, unexpected {keys['unexpected'][:5]}, shape mismatch {keys['shape_mismatch'][:5]}"
            " (is --reference the config this model was trained with?)"
        )
        return False
    return True


def record_loading(report: VerificationReport, out_dir: Path, architecture: str, total_bytes: int,
                   max_bytes: int) -> None:
    """Load the written model with transformers (when under ``max_bytes``) and record it as ``from_pretrained``.

    Args:
        report: verification.json's content, filled in place (an error is added when loading complains).
        out_dir: The written model directory.
        architecture: The transformers class to load it with.
        total_bytes: The model's size; above ``max_bytes`` the load is skipped, and the report says why.
        max_bytes: The largest model worth loading (``consolidate(from_pretrained_max_bytes=...)``).
    """
    if total_bytes > max_bytes:
        report["from_pretrained"] = {"skipped": f"model is {total_bytes} bytes, above the {max_bytes}-byte limit for a load test"}
        return
    loaded = from_pretrained_check(out_dir, architecture)
    report["from_pretrained"] = loaded
    if not loaded.get("ok"):
        report["errors"].append(f"from_pretrained reported problems: {loaded}")


# The lists in transformers' loading info that mean the output does not load cleanly.
_LOADING_PROBLEMS: tuple[Literal["missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"], ...] = (
    "missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
