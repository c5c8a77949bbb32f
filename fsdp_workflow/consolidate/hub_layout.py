"""Write MoE experts under the names and shapes ``save_pretrained`` writes, not transformers 5's in-memory ones.

transformers 5 holds a layer's experts as two fused 3-D parameters (Qwen3-MoE:
``model.layers.N.mlp.experts.gate_up_proj`` [E, 2I, H] and ``...experts.down_proj``
[E, H, I]) and converts them at load time from the per-expert layout the hub holds and
``save_pretrained`` writes (``...mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``,
``down_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``). A trainer saves the
in-memory names, so without this rule the consolidated model of a Qwen3-MoE directory has
other tensors than the directory it came from (vLLM, llama.cpp's converter and older
transformers read only the hub's).

The rule is transformers 5.24's own reverse conversion (``conversion_mapping.py``: the
``qwen2_moe``, ``mixtral`` and ``phimoe`` entries, reverted by
``core_model_loading.revert_weight_conversion``), kept here as a table by ``model_type`` so
that the consolidator needs no transformers import: ``MergeModulelist(dim=0)`` reverted is
"expert ``e`` is index ``e`` of dim 0", ``Concatenate(dim=1)`` reverted is "gate is the first
half of dim 1, up the second"; renames are reverted after the split, as transformers does.
Every output tensor is therefore one box of one source tensor: fixed indices on its leading
dimensions and a range of the next, the rest whole. Inside any DCP chunk such a box is one
contiguous byte range (FSDP2 shards dim 0, so an expert lies whole in one chunk), and the
writer keeps copying byte ranges (:meth:`.reader.SourceTensor.select`).

A ``model_type`` not in the table that transformers converts as one of its rows' patterns
(Cohere2-MoE as Qwen2-MoE; ERNIE-4.5-MoE too, with a renaming besides) takes that row's cut
(:data:`PATTERNS`, :func:`.saved_names.same_conversion_as`, asked at run time).
A ``model_type`` not in the table whose transformers conversion only renames (Granite-MoE:
``block_sparse_moe.input_linear.weight`` on disk, ``experts.gate_up_proj`` in memory) is
written under transformers' own reversed renamings (:mod:`.saved_names`), asked at run time.

Like :func:`.keys.map_keys`, this is a naming rule: the planner and the verifier both call
:func:`hub_pieces`; where the bytes of a box lie each works out on its own.
``tests/consolidate/test_hub_layout.py`` builds every family of :data:`MODEL_TYPES` with
transformers, saves it with ``save_pretrained`` and compares names, shapes and bytes with
what this rule makes of the in-memory state dict, so an upgrade that changes a layout fails
there; at run time the architecture check compares the output's names and shapes with
transformers' own ``revert_weight_conversion`` (:mod:`.verify.architecture`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .consolidation_errors import ConsolidationError
from .jsontypes import JsonObject
from .saved_names import SavedNames, same_conversion_as, saved_names

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """One fused expert parameter and the per-expert tensors it is saved as."""

    module: str  # the experts module, as the end of its path: "mlp.experts" (Qwen2-MoE) or "experts" (Mixtral: any)
    fused: str  # the fused parameter in it: "gate_up_proj" [E, k*X, H] or "down_proj" [E, H, X]
    parts: tuple[str, ...]  # expert e's tensors, the equal parts of dim 1 in order: ("gate_proj.weight", "up_proj.weight")
    hidden_dim: int  # the dimension holding hidden_size (2 for gate_up [E, 2I, H], 1 for down [E, H, I])


@dataclass(frozen=True)
class HubLayout:
    """How one conversion pattern of transformers 5 saves its experts."""

    pattern: str  # transformers' name for the conversion (conversion_mapping.py's key)
    splits: tuple[Split, ...]
    renames: tuple[tuple[str, str], ...] = ()  # (in memory, saved) dotted fragments, on component boundaries
    then: Callable[[str], str] | None = None  # transformers' extra renamings reversed (saved_names.Alike), applied last


_GATE_UP = ("gate_proj.weight", "up_proj.weight")
QWEN2_MOE = HubLayout("qwen2_moe", (Split("mlp.experts", "gate_up_proj", _GATE_UP, 2),
                                    Split("mlp.experts", "down_proj", ("down_proj.weight",), 1)))
_W13 = (Split("experts", "gate_up_proj", ("w1.weight", "w3.weight"), 2), Split("experts", "down_proj", ("w2.weight",), 1))
MIXTRAL = HubLayout("mixtral", _W13, (("mlp", "block_sparse_moe"),))
PHIMOE = HubLayout("phimoe", _W13, (("mlp", "block_sparse_moe"), ("router.weight", "gate.weight")))

# model_type (config.json) -> its layout, as transformers 5.24 maps it (_MODEL_TO_CONVERSION_PATTERN);
# every row is built and saved with transformers by tests/consolidate/test_hub_layout.py.
MODEL_TYPES: dict[str, HubLayout] = {
    **{t: QWEN2_MOE for t in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "flex_olmo", "deepseek_v2",
                              "deepseek_v3", "glm4_moe", "hunyuan_v1_moe")},
    "mixtral": MIXTRAL,
    "minimax": MIXTRAL,
    "phimoe": PHIMOE,
}
TRANSFORMERS_VERSION = "5.24"  # the release whose conversion_mapping.py the table copies
# transformers' conversion names -> the cut above; a model_type not in MODEL_TYPES whose transforms equal one
# of these (cohere2_moe, dots1, glm4_moe_lite, ...: saved_names.same_conversion_as) takes that cut
PATTERNS: dict[str, HubLayout] = {"qwen2_moe": QWEN2_MOE, "mixtral": MIXTRAL, "phimoe": PHIMOE}


@dataclass(frozen=True)
class Piece:
    """One output tensor: a box of one source tensor (named as in memory).

    ``index`` fixes the source's leading dimensions, ``rows`` is a range of the next one,
    every later dimension is whole. A tensor written as it is has ``index == ()`` and
    ``rows is None``.
    """

    name: str  # the output name
    source: str  # the in-memory name it is cut from
    shape: Shape  # the output shape
    index: Shape = ()
    rows: tuple[int, int] | None = None

    @property
    def whole(self) -> bool:
        return not self.index and self.rows is None


@dataclass
class Pieces:
    """:func:`hub_pieces`'s answer: the output tensors in order, and what verification.json should say."""

    pieces: list[Piece]
    notes: list[str]


def layout_for(config: JsonObject | None) -> HubLayout | None:
    """The layout of the reference config's ``model_type``, or None (written as stored).

    A row of :data:`MODEL_TYPES`, or else the cut of the conversion transformers gives this
    type exactly as it gives one of :data:`PATTERNS` (asked of transformers at run time).
    """
    if not config:
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    alike = same_conversion_as(model_type, tuple(PATTERNS))
    if alike is None:
        return None
    return replace(PATTERNS[alike.pattern], then=alike.then) if alike.then else PATTERNS[alike.pattern]


def _rename(name: str, layout: HubLayout) -> str:
    key = f".{name}."
    for a, b in layout.renames:
        key = key.replace(f".{a}.", f".{b}.")
    return layout.then(key[1:-1]) if layout.then else key[1:-1]


def _split_of(name: str, layout: HubLayout) -> tuple[str, Split] | None:
    """(prefix up to and including the experts module, split) when ``name`` is a fused expert parameter."""
    for s in layout.splits:
        tail = f"{s.module}.{s.fused}"
        if name == tail or name.endswith("." + tail):
            return name[: len(name) - len(s.fused) - 1], s
    return None


def hub_pieces(shapes: dict[str, Shape], config: JsonObject | None) -> Pieces:
    """The output tensors for in-memory names: each fused expert tensor cut per expert, the rest renamed or kept.

    Args:
        shapes: In-memory (Hugging Face) name -> shape, in the order to write them.
        config: The reference config.json (its ``model_type`` picks the layout, or transformers'
            renamings where it has no row: :mod:`.saved_names`; None: names kept).

    Returns:
        The pieces, in order (a fused tensor's experts in expert order, each expert's parts
        in order), and notes for verification.json.

    Raises:
        ConsolidationError: A fused expert tensor whose shape is not the layout's (a
            transformers release that changed it: the table needs the new layout), or two
            tensors mapping to one name.
    """
    layout = layout_for(config)
    model_type = config.get("model_type") if config else None
    renamed_by = saved_names(model_type) if layout is None and isinstance(model_type, str) else None
    if renamed_by is not None:
        return _renamed(shapes, renamed_by)
    if layout is None:
        pieces = [Piece(n, n, s) for n, s in shapes.items()]
        fused = sorted(n for n, s in shapes.items() if len(s) == 3 and n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
        notes = []
        if fused:
            notes.append(f"{len(fused)} fused expert tensor(s) (e.g. '{fused[0]}') written as the checkpoint holds them: "
                         f"model_type {model_type!r} is not in the consolidator's table of transformers {TRANSFORMERS_VERSION}'s "
                         "saved expert layouts (fsdp_workflow/consolidate/hub_layout.py), so tools expecting the hub's "
                         "per-expert names (vLLM, llama.cpp) may not read them")
        return Pieces(pieces, notes)
    return _cut(shapes, layout, config, model_type)


def _renamed(shapes: dict[str, Shape], rule: SavedNames) -> Pieces:
    """Every tensor whole, under the name transformers' reversed renamings give it (:mod:`.saved_names`)."""
    out = [Piece(rule.rename(n), n, s) for n, s in shapes.items()]
    seen: dict[str, str] = {}
    for p in out:
        if p.name in seen:
            raise ConsolidationError(f"'{seen[p.name]}' and '{p.source}' both become '{p.name}' under transformers "
                                     f"{rule.version}'s saved names for model_type {rule.model_type!r}; the checkpoint "
                                     "mixes in-memory and saved names")
        seen[p.name] = p.source
    renamed = [p for p in out if p.name != p.source]
    notes = [f"written as save_pretrained writes model_type {rule.model_type!r} (transformers {rule.version}'s "
             f"renamings, reversed): {len(renamed)} tensor(s) renamed, e.g. '{renamed[0].source}' -> "
             f"'{renamed[0].name}'"] if renamed else []
    return Pieces(out, notes)


def _cut(shapes: dict[str, Shape], layout: HubLayout, config: JsonObject | None, model_type: object) -> Pieces:
    """:func:`hub_pieces` for a ``model_type`` of the table: fused experts cut per expert, the rest renamed."""
    hidden = config.get("hidden_size") if config else None
    out: list[Piece] = []
    split = 0
    for name, shape in shapes.items():
        found = _split_of(name, layout)
        if found is None:
            out.append(Piece(_rename(name, layout), name, shape))
            continue
        prefix, s = found
        k = len(s.parts)
        if len(shape) != 3 or shape[1] % k or (isinstance(hidden, int) and shape[s.hidden_dim] != hidden):
            raise ConsolidationError(
                f"'{name}' has shape {list(shape)}; transformers {TRANSFORMERS_VERSION}'s {layout.pattern} layout fuses "
                f"experts as [experts, {k} x rows, ...] with hidden_size ({hidden}) on dim {s.hidden_dim}. The installed "
                "transformers stores them otherwise: fsdp_workflow/consolidate/hub_layout.py needs its layout")
        rows = shape[1] // k
        split += 1
        for e in range(shape[0]):
            for i, part in enumerate(s.parts):
                out.append(Piece(_rename(f"{prefix}.{e}.{part}", layout), name, (rows, shape[2]), (e,),
                                 (i * rows, (i + 1) * rows)))
    seen: dict[str, str] = {}
    for p in out:
        if p.name in seen:
            raise ConsolidationError(f"'{seen[p.name]}' and '{p.source}' both map to '{p.name}' in the {layout.pattern} "
                                     "layout; the checkpoint mixes fused and per-expert names")
        seen[p.name] = p.source
    notes = []
    renamed = sum(1 for p in out if p.whole and p.name != p.source)
    if split or renamed:
        notes.append(f"written as save_pretrained writes model_type {model_type!r} "
                     f"(transformers {TRANSFORMERS_VERSION}'s {layout.pattern} layout): {split} fused expert tensor(s) "
                     f"cut into {sum(1 for p in out if not p.whole)} per-expert tensors, {renamed} tensor(s) renamed")
    return Pieces(out, notes)
