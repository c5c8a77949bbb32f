"""Plan-time rules of the data group: caught before anything is submitted, without torch or transformers.

Run by :func:`fsdp_workflow.plan.checks.check` with the config stage's rules.
The expensive truths (a record lacking a field, an overlong sample) are the
prepare step's; here: combinations that cannot work, keys that would be
ignored, and a chat template that does not exist.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.schema import (
    DATA_FIELDS,
    ClusterKind,
    DataFormat,
    DataSource,
    TrainOn,
    WorkflowConfig,
)
from fsdp_workflow.data.mixture import Source, resolve_sources
from fsdp_workflow.data.rules_mixture import check_sources
from fsdp_workflow.data.template_markers import check_template_markers, template_fix
from fsdp_workflow.data.templates import SHIPPED_TEMPLATES
from fsdp_workflow.data.tokenizer import tokenizer_source  # imports transformers only when loading

# Files in a Hugging Face tokenizer directory that may hold its chat template.
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def is_inline_template(value: str) -> bool:
    """A ``data.chat_template`` holding Jinja itself rather than a shipped name."""
    return "{{" in value or "{%" in value


def tokenizer_has_template(directory: str) -> Optional[bool]:
    """Whether the tokenizer directory ships a chat template; None when it cannot be read here."""
    if not os.path.isdir(directory):
        return None
    if any(os.path.isfile(os.path.join(directory, f)) for f in TEMPLATE_FILES):
        return True
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def _check_template_value(cfg: WorkflowConfig, r: ValidationReport, key: str, value: str) -> None:
    """``data.chat_template`` or ``data.fallback_chat_template`` names something that exists."""
    if value.endswith(".jinja"):
        if not os.path.isfile(value):
            hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
            (r.error if hard else r.warn)(
                key, value, "no such template file" + ("" if hard else " here (fine if it exists on the cluster)"),
                f"{key}=/absolute/path/to/template.jinja")
    elif not is_inline_template(value) and value not in SHIPPED_TEMPLATES:
        r.error(key, value, "neither a shipped template, a .jinja file nor a Jinja template",
                f"one of {', '.join(sorted(SHIPPED_TEMPLATES))}, a path to a .jinja file, a template string, or "
                "null for the tokenizer's own")


def _check_template(cfg: WorkflowConfig, r: ValidationReport, formats: List[DataFormat]) -> None:
    d = cfg.data
    uses_template = DataFormat.conversation in formats
    if d.fallback_chat_template:
        _check_template_value(cfg, r, "data.fallback_chat_template", d.fallback_chat_template)
    if d.chat_template is not None:
        if all(f == DataFormat.text for f in formats):
            r.error("data.chat_template", d.chat_template, "data.format=text reads plain text: no template applies",
                    "data.chat_template=null, or data.format=conversation")
        else:
            _check_template_value(cfg, r, "data.chat_template", d.chat_template)
        return
    if not uses_template or d.fallback_chat_template:
        return  # a tokenizer without a template of its own gets the fallback (template_markers names which)
    directory = tokenizer_source(cfg.model)
    fix = f"data.chat_template={sorted(SHIPPED_TEMPLATES)[0]} (or a Jinja template string)"
    if directory is None:
        r.error("data.chat_template", None,
                "data.format=conversation needs a chat template, and the built-in byte-level tokenizer has none", fix)
        return
    has = tokenizer_has_template(directory)
    if has is False:
        fix = template_fix(directory)  # a shipped template whose markers this vocabulary holds, if any
        r.error("data.chat_template", None,
                f"data.format=conversation needs a chat template, and the tokenizer in {directory} has none", fix)
    elif has is None:
        r.warn("data.chat_template", None,
               f"cannot read the tokenizer in {directory} here to see whether it has a chat template "
               "(fine if it does on the cluster)", fix + " to be sure")


def _check_source_format(src: Source, r: ValidationReport) -> None:
    """One source's reader, format and field keys (``data.*`` for data.path, ``data.sources[i].*`` in a mixture)."""
    if src.source == DataSource.text and src.format != DataFormat.text:
        r.error(src.sub("format"), src.format, f"{src.sub('source')}=text reads plain text files, which have no "
                "fields", f"{src.sub('format')}=text, or {src.sub('source')}=jsonl for records")
    unknown = sorted(set(src.fields) - set(DATA_FIELDS))
    if unknown:
        r.error(src.sub("fields"), dict(src.fields), f"unknown field name(s) {unknown}",
                f"map these canonical names only: {', '.join(DATA_FIELDS)}")
    if src.format == DataFormat.text:
        if src.fields:
            r.error(src.sub("fields"), dict(src.fields), f"{src.sub('format')}=text reads one field, "
                    f"{src.sub('text_field')}", f"{src.sub('text_field')}=NAME instead of {src.sub('fields')}")
    elif src.text_field != "text":
        r.error(src.sub("text_field"), src.text_field, f"{src.sub('format')}={src.format.value} reads "
                f"{src.sub('fields')}, not text_field",
                f"{src.sub('fields')}.NAME=... (e.g. +{src.sub('fields')}.messages=conversation)")


def check_data_format(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Format, source and masking keys that only make sense together (for every source of a mixture)."""
    d = cfg.data
    if d.source == DataSource.synthetic and not d.sources:
        changed = [k for k, v in (("format", d.format != DataFormat.text), ("chat_template", d.chat_template),
                                  ("fields", d.fields), ("cache_dir", d.cache_dir)) if v]
        for key in changed:
            r.error(f"data.{key}", getattr(d, key), "data.source=synthetic draws random tokens: nothing is read "
                    "or prepared", f"remove data.{key}, or a file source (data=jsonl data.path=...)")
        return
    sources = resolve_sources(d) if d.sources else [
        Source(0, "data.path", "", d.path or "", d.source, d.format, d.text_field, dict(d.fields), None, None)]
    for src in sources:
        if src.source != DataSource.synthetic:
            _check_source_format(src, r)
    formats = [s.format for s in sources]
    if all(f == DataFormat.text for f in formats) and d.train_on != TrainOn.assistant:
        r.error("data.train_on", d.train_on, "data.format=text trains every token; train_on chooses among "
                "the turns of conversations, completions and outputs", "remove data.train_on, or another format")
    if all(f == DataFormat.text for f in formats) and d.allow_no_user:
        r.error("data.allow_no_user", True, "data.format=text has no turns: every token is trained, asked or not",
                "data.allow_no_user=false (the default), or a format with answers: conversation, "
                "prompt_completion, alpaca")
    if DataFormat.prompt_completion in formats and d.train_on == TrainOn.last_assistant and \
            DataFormat.conversation not in formats:
        r.warn("data.train_on", d.train_on, "a prompt/completion pair has one completion: the same as assistant",
               "data.train_on=assistant")
    _check_template(cfg, r, formats)


RULES = [check_data_format, check_sources]


# ------------------------------------------------------------------ vocabulary (appended for issue 24)
TOKENIZER_FILE = "tokenizer.json"  # a fast tokenizer's whole vocabulary, added tokens included
MODEL_CONFIG_FILE = "config.json"


def _max_id(node: object) -> int:
    """The largest token id of a ``tokenizer.json`` model vocabulary (-1 when there is none).

    BPE, WordPiece and WordLevel map token -> id; Unigram lists ``[token, score]`` (the id is the index).
    """
    if isinstance(node, dict):
        ids = [v for v in node.values() if isinstance(v, int)]
        return max(ids, default=-1)
    if isinstance(node, list):
        return len(node) - 1
    return -1


def tokenizer_vocab_size(directory: str) -> Optional[int]:
    """How many ids a tokenizer directory can produce (its largest id + 1), read from its JSON files.

    Planning must not import transformers (it imports torch), so the size comes from
    ``tokenizer.json`` (the model's vocabulary and ``added_tokens``) and
    ``tokenizer_config.json`` (``added_tokens_decoder``). A test checks it against
    ``len(AutoTokenizer.from_pretrained(directory))``.

    Returns:
        The size, or None when neither file can be read here (e.g. a slow tokenizer only).
    """
    largest, found = -1, False
    try:
        with open(os.path.join(directory, TOKENIZER_FILE), encoding="utf-8") as f:
            data = json.load(f)
        largest = max(largest, _max_id((data.get("model") or {}).get("vocab")))
        largest = max([largest, *(t.get("id", -1) for t in data.get("added_tokens") or [] if isinstance(t, dict))])
        found = True
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG), encoding="utf-8") as f:
            decoder = json.load(f).get("added_tokens_decoder") or {}
        largest = max([largest, *(int(k) for k in decoder if str(k).isdigit())])
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return largest + 1 if found and largest >= 0 else None


def _embedding_rows(cfg: WorkflowConfig) -> Optional[int]:
    """``model.vocab_size`` for a random init, else the pretrained model's ``config.json`` (None if unreadable)."""
    from fsdp_workflow.config.schema import ModelInit

    if cfg.model.init == ModelInit.random or not cfg.model.name_or_path:
        return cfg.model.vocab_size
    try:
        with open(os.path.join(cfg.model.name_or_path, MODEL_CONFIG_FILE), encoding="utf-8") as f:
            value = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def check_vocab_fits(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """The tokenizer's ids fit the model's embedding rows: refused at planning, not in prepare or on a GPU."""
    from fsdp_workflow.config.schema import ModelInit
    from fsdp_workflow.data.tokenizer import BYTE_VOCAB_SIZE

    if cfg.data.source == DataSource.synthetic:
        return  # random ids below model.vocab_size: no tokenizer runs
    directory = tokenizer_source(cfg.model)
    size = BYTE_VOCAB_SIZE if directory is None else tokenizer_vocab_size(directory)
    rows = _embedding_rows(cfg)
    if size is None or rows is None or size <= rows:
        return
    source = "the built-in byte-level tokenizer" if directory is None else f"the tokenizer in {directory}"
    why = (f"{source} has {size} token ids but the model has {rows} embedding rows: ids past {rows - 1} "
           "would crash training")
    if cfg.model.init == ModelInit.random:
        r.error("model.vocab_size", rows, why, f"model.vocab_size={size} (or a model.tokenizer with at most {rows} ids)")
    else:
        r.error("model.tokenizer", directory, why + f" (the model's {MODEL_CONFIG_FILE} says vocab_size={rows})",
                "model.tokenizer=null to use the model's own tokenizer (or one with at most that many ids)")


RULES.append(check_vocab_fits)
RULES.append(check_template_markers)
