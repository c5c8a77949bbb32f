"""The names ``save_pretrained`` writes, asked of transformers, for a ``model_type`` whose conversion only renames.

transformers 5 renames some families' tensors when it loads them and renames them back when
it saves (``conversion_mapping.py``; reverted by ``core_model_loading.revert_weight_conversion``):
Granite-MoE holds ``block_sparse_moe.experts.gate_up_proj`` and ``router.weight`` where its
directory, and ``save_pretrained``, have ``block_sparse_moe.input_linear.weight`` and
``router.layer.weight``; EXAONE 3 holds ``model.layers.N`` where its directory has
``transformer.h.N``. A trainer checkpoints the names held in memory, so the consolidator
renames them back: with transformers' own reversed renamings (``reverse_transform`` and
``apply_renamings``, what ``revert_weight_conversion`` applies to every key no converter
takes), not a table of ours, so every family transformers renames is covered.

Conversions that do more than rename (fused experts cut per expert: Qwen2-MoE, Mixtral,
PhiMoE) are :mod:`.hub_layout`'s table, which copies them as boxes of bytes; a type not in
the table whose transforms transformers gives exactly as one of those patterns takes its cut
(:func:`same_conversion_as`); any other, or one with a ``PrefixChange``, is written as held,
with a note.

Importing transformers costs seconds, so it is asked only for a ``model_type`` that its
``conversion_mapping.py`` names at all (read as text first), and once per process.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SavedNames:
    """transformers' reversed renamings for one ``model_type``."""

    model_type: str
    version: str  # the transformers release asked
    rename: Callable[[str], str]  # the in-memory name -> the name save_pretrained writes


def _named_by_transformers(model_type: str) -> bool:
    """Whether transformers' ``conversion_mapping.py`` mentions ``model_type`` (without importing transformers)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = Path(next(iter(spec.submodule_search_locations))) / "conversion_mapping.py"
    try:
        return f'"{model_type}"' in path.read_text(encoding="utf-8")
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def saved_names(model_type: str) -> SavedNames | None:
    """transformers' rule for the names ``save_pretrained`` writes, when its conversion for ``model_type`` only renames.

    Args:
        model_type: config.json's ``model_type``.

    Returns:
        The rule, or None: transformers is not installed, has no conversion for this
        type, or its conversion does more than rename (then :mod:`.hub_layout` decides).
    """
    if not model_type or not _named_by_transformers(model_type):
        return None
    try:
        import transformers
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # a transformers without load-time conversions saves what it holds
        return None
    conversions = get_checkpoint_conversion_mapping(model_type)
    # only plain renamings: a PrefixChange (or any other subclass) depends on the checkpoint loaded
    if not conversions or any(type(c) is not WeightRenaming for c in conversions):
        return None
    reverse = [c.reverse_transform() for c in reversed(conversions)]  # as revert_weight_conversion orders them
    return SavedNames(model_type, transformers.__version__, lambda name: apply_renamings(name, reverse))


def _signature(transform: object) -> tuple | None:
    """What a conversion does, comparable between model types: its class, patterns and operations."""
    try:
        ops = tuple((type(o).__name__, getattr(o, "dim", None)) for o in getattr(transform, "operations", ()) or ())
        return (type(transform).__name__, tuple(transform._original_source_patterns),  # type: ignore[attr-defined]
                tuple(transform._original_target_patterns), ops)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return None


@dataclass(frozen=True)
class Alike:
    """A model type converted as one of :mod:`.hub_layout`'s patterns, perhaps with plain renamings besides."""

    pattern: str  # transformers' conversion name: "qwen2_moe", "mixtral", "phimoe"
    then: Callable[[str], str] | None = None  # the extra renamings reversed, applied after the pattern's cut


@functools.lru_cache(maxsize=None)
def same_conversion_as(model_type: str, patterns: tuple[str, ...]) -> Alike | None:
    """Which of ``patterns`` (transformers' conversion names, e.g. ``"qwen2_moe"``) converts ``model_type`` alike.

    transformers maps many model types onto one conversion (Cohere2-MoE, dots1, GLM-4-MoE-Lite
    and a dozen more save their experts as Qwen2-MoE does); :mod:`.hub_layout` keeps one cut
    per conversion. A type whose transforms are a pattern's, class for class and pattern for
    pattern, takes that cut; one with plain renamings besides (ERNIE-4.5-MoE, EXAONE-MoE and
    MiniMax-M2 move their routers' score-correction bias) takes it with those renamings
    reversed after it, as ``revert_weight_conversion`` renames a converter's output.

    Returns:
        The pattern and the extra renamings, or None (transformers absent, or nothing alike).
    """
    if not model_type or not _named_by_transformers(model_type):
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:
        return None
    transforms = list(get_checkpoint_conversion_mapping(model_type) or ())
    mine = [_signature(t) for t in transforms]
    if not mine or None in mine:
        return None
    for pattern in patterns:
        theirs = [_signature(t) for t in get_checkpoint_conversion_mapping(pattern) or ()]
        left = list(theirs)
        extra = []
        for t, sig in zip(transforms, mine):
            if sig in left:
                left.remove(sig)
            else:
                extra.append(t)
        if left or any(type(t) is not WeightRenaming for t in extra):
            continue
        if not extra:
            return Alike(pattern)
        reverse = [t.reverse_transform() for t in reversed(extra)]
        return Alike(pattern, lambda name: apply_renamings(name, reverse))
    return None
