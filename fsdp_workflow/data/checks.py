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


def _check_template(cfg: WorkflowConfig, r: ValidationReport, formats: List[DataFormat]) -> None:
    d = cfg.data
    uses_template = DataFormat.conversation in formats
    if d.chat_template is not None:
        if all(f == DataFormat.text for f in formats):
            r.error("data.chat_template", d.chat_template, "data.format=text reads plain text: no template applies",
                    "data.chat_template=null, or data.format=conversation")
        elif d.chat_template.endswith(".jinja"):
            if not os.path.isfile(d.chat_template):
                hard = cfg.cluster.kind == ClusterKind.local and not cfg.dry_run
                (r.error if hard else r.warn)(
                    "data.chat_template", d.chat_template,
                    "no such template file" + ("" if hard else " here (fine if it exists on the cluster)"),
                    "data.chat_template=/absolute/path/to/template.jinja")
        elif not is_inline_template(d.chat_template) and d.chat_template not in SHIPPED_TEMPLATES:
            r.error("data.chat_template", d.chat_template, "neither a shipped template, a .jinja file nor a "
                    "Jinja template", f"one of {', '.join(sorted(SHIPPED_TEMPLATES))}, a path to a .jinja file, "
                    "a template string, or null for the tokenizer's own")
        return
    if not uses_template:
        return
    directory = tokenizer_source(cfg.model)
    fix = f"data.chat_template={sorted(SHIPPED_TEMPLATES)[0]} (or a Jinja template string)"
    if directory is None:
        r.error("data.chat_template", None,
                "data.format=conversation needs a chat template, and the built-in byte-level tokenizer has none", fix)
        return
    has = tokenizer_has_template(directory)
    if has is False:
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
    if DataFormat.prompt_completion in formats and d.train_on == TrainOn.last_assistant and \
            DataFormat.conversation not in formats:
        r.warn("data.train_on", d.train_on, "a prompt/completion pair has one completion: the same as assistant",
               "data.train_on=assistant")
    _check_template(cfg, r, formats)


RULES = [check_data_format, check_sources]
