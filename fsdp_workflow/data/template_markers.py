"""Plan-time rule: the chat template that will train, and markers the vocabulary would split.

The model directory is the truth (docs/data.md, "Which template trains"):
``data.chat_template`` when the user names one, else the tokenizer's own, else
``data.fallback_chat_template`` (what a shipped experiment names, e.g. ``chatml``
for the tiny byte-level models). :func:`check_template_markers` says which one
trains (a note), and refuses a named or fallback template whose turn markers
(``<|im_start|>``, ``<start_of_turn>``, ``[INST]``...) are not tokens of the
tokenizer's vocabulary: each would be split into several pieces, which a model
never saw as its turn boundaries, and the run would train and "verify" on them
without a word. The tokens are not added for the user (that would change the
vocabulary and the embeddings the directory defines); the message says what to
name instead.

Read as JSON (``tokenizer.json``, ``tokenizer_config.json``, ``added_tokens.json``)
and rendered with jinja2: no torch, no transformers. The byte-level tokenizer of
the tiny random models has no vocabulary to speak of (every marker is spelled in
bytes, by design) and is not checked.
"""

from __future__ import annotations

import json
import os
import re
from typing import List, Optional, Set

from fsdp_workflow.config.errors import ValidationReport
from fsdp_workflow.config.schema import DataFormat, DataSource, WorkflowConfig
from fsdp_workflow.data.mixture import resolve_sources
from fsdp_workflow.data.templates import SHIPPED_TEMPLATES, TemplateError, choose_template
from fsdp_workflow.data.tokenizer import tokenizer_source

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
ADDED_TOKENS_FILE = "added_tokens.json"  # a slow tokenizer's added tokens
TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 writes the template apart
TEMPLATE_JSON = "chat_template.json"

# What a turn marker looks like: <|im_start|>, <｜User｜> (DeepSeek), <start_of_turn>, </s>, [INST], [/INST].
_MARKER = re.compile(r"<\|[^<>|\s]{1,64}\|>|<｜[^<>\s]{1,64}｜>|</?[A-Za-z_][A-Za-z0-9_.:-]{0,63}>"
                     r"|\[/?[A-Z][A-Z_]{1,63}\]")
# Only a special token is spelled with bars: one of these that the vocabulary splits is refused. A tag or a
# bracketed word (<answer>, [INST]) may be plain text a template of your own writes on purpose: a warning.
_SPECIAL = re.compile(r"<\|.*\|>|<｜.*｜>")
_CONTENT = ("\u2063sys\u2063", "\u2063qu1\u2063", "\u2063an1\u2063", "\u2063qu2\u2063")


def own_template(directory: str) -> Optional[str]:
    """The tokenizer directory's own chat template (None when it has none or it cannot be read here)."""
    try:
        with open(os.path.join(directory, TEMPLATE_FILE), encoding="utf-8") as f:
            return f.read()
    except OSError:
        pass
    for name in (TEMPLATE_JSON, TOKENIZER_CONFIG):
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                value = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):  # several named templates: transformers takes "default"
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                         None)
        if isinstance(value, str) and value.strip():
            return value
    return None


def template_markers(text: str) -> List[str]:
    """The turn markers a template writes around an ordinary conversation, in order of first use.

    Found by rendering a probe (system, user, assistant, user; without the system turn
    when the template refuses one) and taking the marker-shaped strings outside the
    messages: a template's tool tags, which appear only with tools, are not among them.
    Empty when the template does not render here (the prepare step then says why).
    """
    from fsdp_workflow.data.templates import compile_template

    sys_, q1, a1, q2 = _CONTENT
    probe = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    try:
        compiled = compile_template(text)
    except TemplateError:
        return []
    for messages in ([{"role": "system", "content": sys_}] + probe, probe):
        try:
            rendered = compiled.render(messages, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template may raise anything (Gemma 2 on a system turn)
            continue
        for content in _CONTENT:
            rendered = rendered.replace(content, "\n")
        return list(dict.fromkeys(_MARKER.findall(rendered)))
    return []


def vocabulary_tokens(directory: str) -> Optional[Set[str]]:
    """Every whole token of a tokenizer directory: its vocabulary and its added tokens.

    None without a readable ``tokenizer.json`` (a slow tokenizer's vocabulary is a binary
    model file), or for the byte-level tokenizer of the tiny models saved to a directory
    (a BPE without merges): neither is judged.
    """
    tokens: Set[str] = set()
    found = False
    try:
        with open(os.path.join(directory, TOKENIZER_FILE), encoding="utf-8") as f:
            data = json.load(f)
        model = data.get("model") or {}
        if model.get("type") == "BPE" and not model.get("merges"):
            return None  # a byte-level vocabulary without merges (the tiny models'): every marker is bytes, by design
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            tokens.update(str(k) for k in vocab)
        elif isinstance(vocab, list):  # Unigram: [token, score] pairs
            tokens.update(str(v[0]) for v in vocab if isinstance(v, list) and v)
        tokens.update(str(t.get("content")) for t in data.get("added_tokens") or [] if isinstance(t, dict))
        found = True
    except (OSError, ValueError, AttributeError, TypeError):
        return None  # a slow tokenizer's vocabulary is in a binary model file: not judged here
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG), encoding="utf-8") as f:
            decoder = json.load(f).get("added_tokens_decoder") or {}
        tokens.update(str(t.get("content")) for t in decoder.values() if isinstance(t, dict))
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    try:
        with open(os.path.join(directory, ADDED_TOKENS_FILE), encoding="utf-8") as f:
            added = json.load(f)
        tokens.update(str(k) for k in added)
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return tokens if found else None


def fitting_templates(directory: str) -> Optional[List[str]]:
    """The shipped templates whose markers are all tokens of the tokenizer in ``directory`` (None: not judged)."""
    vocab = vocabulary_tokens(directory)
    if vocab is None:
        return None
    return [name for name, text in sorted(SHIPPED_TEMPLATES.items()) if all(m in vocab for m in template_markers(text))]


def template_fix(directory: Optional[str]) -> str:
    """The fix for a tokenizer without a template: a shipped one its vocabulary can spell, else one of your own."""
    fits = fitting_templates(directory) if directory is not None else None
    if fits is None:
        return f"data.chat_template={sorted(SHIPPED_TEMPLATES)[0]} (or a Jinja template string)"
    if fits:
        return f"data.chat_template={fits[0]} (its markers are tokens of this vocabulary; or a Jinja template string)"
    return ("data.chat_template='<a Jinja template of your own>' whose turns are plain text or tokens of this "
            f"vocabulary: no shipped template's markers are ({', '.join(sorted(SHIPPED_TEMPLATES))} would be "
            "refused; docs/data.md, Chat templates)")


def _uses_template(cfg: WorkflowConfig) -> bool:
    """Whether a source is rendered with the template (prepare.needs_template's rule; prepare imports NumPy)."""
    d = cfg.data
    formats = [s.format for s in resolve_sources(d)] or [d.format]
    return any(f == DataFormat.conversation or (f in (DataFormat.prompt_completion, DataFormat.alpaca)
                                               and bool(d.chat_template)) for f in formats)


def check_template_markers(cfg: WorkflowConfig, r: ValidationReport) -> None:
    """Name the template that trains; refuse one whose markers the tokenizer's vocabulary splits."""
    d = cfg.data
    if d.source == DataSource.synthetic and not d.sources:
        return
    directory = tokenizer_source(cfg.model)
    if directory is None or not os.path.isdir(directory) or not _uses_template(cfg):
        return  # the byte-level tokenizer spells every marker in bytes, by design; an unreadable one: at prepare
    own = own_template(directory)
    try:
        choice = choose_template(d.chat_template, d.fallback_chat_template, own, directory)
    except TemplateError:
        return  # no template or a name that names nothing: the data rules report it
    if choice.key is None:
        if d.fallback_chat_template:
            r.notes.append(f"data: the chat template is the tokenizer's own ({directory}): it trains and hf_model/ "
                           f"ships it; data.fallback_chat_template={d.fallback_chat_template} is only for a "
                           "tokenizer without one (data.chat_template=NAME trains on another)")
        return
    vocab = vocabulary_tokens(directory)
    if vocab is None:
        return  # no tokenizer.json here, or the tiny models' bytes: nothing to judge at planning
    unknown = [m for m in template_markers(choice.text) if m not in vocab]
    split = [m for m in unknown if _SPECIAL.fullmatch(m)]
    tags = [m for m in unknown if m not in split]
    if tags:
        r.warn("data.chat_template", d.chat_template,
               f"the template {choice.label} writes {', '.join(tags)}, which the tokenizer in {directory} has no "
               "token for: if these are meant as turn markers, each is split into several ordinary tokens",
               "fine if they are plain text on purpose; else a template whose markers are tokens of this vocabulary"
               + (" (data.chat_template=null: the directory's own)" if own else ""))
    if not split:
        if choice.key == "data.fallback_chat_template":
            r.notes.append(f"data: the tokenizer in {directory} has no chat template: "
                           f"data.fallback_chat_template={choice.label} trains, and hf_model/ ships it")
        elif own:
            r.notes.append(f"data: data.chat_template={choice.label} trains instead of the tokenizer's own "
                           f"({directory}), and hf_model/ ships it")
        return
    value = d.chat_template if choice.key == "data.chat_template" else None
    whose = ("" if choice.key == "data.chat_template" else
             f" (data.chat_template is unset and the tokenizer has no template, so the run's "
             f"data.fallback_chat_template={choice.label} would train)")
    fits = [name for name, text in sorted(SHIPPED_TEMPLATES.items())
            if name != choice.label and all(m in vocab for m in template_markers(text))]
    fixes = (["data.chat_template=null to train on the directory's own template"] if own else []) + \
        [f"data.chat_template={name} (its markers are tokens here)" for name in fits] + \
        ["a Jinja template of your own whose markers are tokens of this vocabulary (or plain text)",
         "model.tokenizer=DIR of a tokenizer that has these tokens (they are not added for you: that would "
         "change the vocabulary and the embeddings)"]
    r.error("data.chat_template", value,
            f"the template {choice.label}{whose} writes the marker(s) {', '.join(split)}, which are not tokens of "
            f"the tokenizer in {directory}: each would be split into several ordinary tokens, and the model "
            "would learn its turns from fragments it never saw as markers",
            "; or ".join(fixes))
