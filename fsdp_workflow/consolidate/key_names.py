"""Map DCP keys to Hugging Face parameter names.

``model.model.layers.0.self_attn.q_proj.weight`` (DCP root ``model`` + HF name) becomes
``model.layers.0.self_attn.q_proj.weight``; wrapper components such as
``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module`` and ``_orig_mod`` are dropped
wherever they appear, and leading ``module`` / ``_forward_module`` (DDP, Lightning) too.
Training state beside the model (optimizer, scheduler, dataloader, ...) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from .consolidation_errors import ConsolidationError
from .reader import SourceTensor

# Top-level DCP keys that are never the model's own weights (trainer, Accelerate, torchtitan, Lightning);
# "ema" is an average of them, taken with --subtree ema.
NON_MODEL_ROOTS = frozenset({
    "ema",
    "optimizer", "optimizers", "optim", "optimizer_states", "optim_state", "lr_scheduler", "lr_schedulers",
    "scheduler", "schedulers", "dataloader", "train_state", "trainer", "rng", "rng_state", "rng_states",
    "random_states", "loops", "callbacks", "extra_state", "grad_scaler", "scaler",
})
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Roots stripped when every model key shares them.
STRIPPABLE_ROOTS = ("model", "state_dict", "module", "_forward_module")
TIED_OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight")
TIED_INPUT_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
_BASE_MODEL_PARTS = frozenset({"layers", "embed_tokens", "norm", "h", "wte", "decoder", "encoder"})


def _clean(parts: list[str]) -> list[str]:
    return [p for p in parts if p not in WRAPPER_COMPONENTS]


def map_keys(fqns: list[str], subtree: str | None = None, causal_lm: bool = True) -> dict[str, str]:
    """Choose the model keys among ``fqns`` and give each its Hugging Face name.

    Args:
        fqns: Tensor keys of the checkpoint, in order.
        subtree: Keep only keys under this root (e.g. ``"ema"``) and strip it.
        causal_lm: The reference architecture is a ``*ForCausalLM`` whose names start with
            ``model.``: never strip a ``model`` root that would leave bare ``layers.*`` names.

    Returns:
        Output name -> DCP key, in checkpoint order.

    Raises:
        ConsolidationError: no model keys, an unknown subtree, or two keys mapping to one name.
    """
    split = {f: _clean(f.split(".")) for f in fqns}
    if subtree:
        sub = subtree.strip(".").split(".")
        kept = {f: p[len(sub):] for f, p in split.items() if p[: len(sub)] == sub and len(p) > len(sub)}
        if not kept:
            top = sorted({p[0] for p in split.values()})
            raise ConsolidationError(f"--subtree '{subtree}': no tensor keys under it; the checkpoint's top-level keys are {top}")
    else:
        kept = {f: p for f, p in split.items() if p and p[0] not in NON_MODEL_ROOTS}
        if not kept:
            top = sorted({p[0] for p in split.values() if p})
            raise ConsolidationError(f"no model tensors found: the checkpoint's top-level keys are {top}, all of them training state")
    while True:
        roots = {p[0] for p in kept.values()}
        if len(roots) != 1 or any(len(p) < 2 for p in kept.values()):
            break
        root = next(iter(roots))
        if root not in STRIPPABLE_ROOTS:
            break
        rest = {f: p[1:] for f, p in kept.items()}
        if root == "model" and causal_lm:
            new_roots = {p[0] for p in rest.values()}
            if "model" not in new_roots and "lm_head" not in new_roots and new_roots & _BASE_MODEL_PARTS:
                break  # these are already HF causal-LM names without lm_head (tied)
        kept = rest
    out: dict[str, str] = {}
    for fqn, parts in kept.items():
        while len(parts) > 1 and parts[0] in ("module", "_forward_module"):
            parts = parts[1:]
        name = ".".join(parts)
        if name in out:
            raise ConsolidationError(f"keys '{out[name]}' and '{fqn}' both map to '{name}' after removing wrapper prefixes; pass --subtree to pick one")
        out[name] = fqn
    return out


def fix_architecture(name: str) -> str:
    """Remove the FSDP2 class prefix (``FSDPLlamaForCausalLM``): a prefix, not ``lstrip``."""
    if name.startswith("FSDP") and len(name) > 4 and name[4].isupper():
        return name[4:]
    return name


WRAPPER_CLASS_NAMES = frozenset({"FullyShardedDataParallel", "DistributedDataParallel", "OptimizedModule", "CheckpointWrapper", "DataParallel"})


@dataclass(frozen=True)
class TiedPair:
    """An output embedding config.json ties to the input embedding: written once, as the input."""

    dropped: str  # e.g. lm_head.weight
    kept: str  # e.g. model.embed_tokens.weight
    dropped_source: SourceTensor  # in the newest checkpoint, to check the two were really equal
    kept_source: SourceTensor


def tied_pair(names: list[str], config: dict | None, newest: dict[str, SourceTensor]) -> TiedPair | None:
    """The (output, input) embedding pair to write once, when config.json ties them and the shapes agree.

    A naming rule like :func:`map_keys`, so the planner and the verifier both call it.
    """
    if not config or config.get("tie_word_embeddings") is not True:
        return None
    out = next((n for n in TIED_OUTPUT_NAMES if n in newest), None)
    inp = next((n for n in names if n.endswith(TIED_INPUT_SUFFIXES) and n != out), None)
    if out and inp and newest[out].shape == newest[inp].shape:
        return TiedPair(out, inp, newest[out], newest[inp])
    return None
