"""Chat templates: the shipped ones, resolving ``data.chat_template``, rendering.

``data.chat_template`` is one of:

- unset: the tokenizer's own ``chat_template`` (the model directory is the truth);
- a shipped name (:data:`SHIPPED_TEMPLATES`, e.g. ``chatml``);
- a Jinja template string (it contains ``{{`` or ``{%``) or the path of a ``.jinja`` file.

``data.fallback_chat_template`` (the same kinds of value) is what a shipped experiment
names: it applies only when ``data.chat_template`` is unset and the tokenizer has no
template of its own (:func:`choose_template`). Whichever trains is what ``hf_model/``
ships (:mod:`fsdp_workflow.train.assets`).

Every conversation is rendered once. Where the template marks assistant turns
with ``{% generation %}`` (the shipped ones do), the trained characters are
exactly the marked blocks, as ``transformers``' ``return_assistant_tokens_mask``
has them. Where it does not (the stock templates of real models), they are
each assistant message's content, found in that one rendering, plus the
end-of-turn marker the template writes after it
(:mod:`fsdp_workflow.data.spans`).

Rendering uses the environment ``transformers`` uses for ``apply_chat_template``
(sandboxed Jinja, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, a ``tojson`` that does not escape HTML). This module
imports neither torch nor transformers (jinja2 only when rendering), so
planning can list :data:`SHIPPED_TEMPLATES`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Tuple

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# name -> Jinja template (each marks assistant turns with {% generation %})
SHIPPED_TEMPLATES: Dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3}


class TemplateError(ValueError):
    """``data.chat_template`` names nothing usable, or the tokenizer has no template; the message says the fix."""


def is_template_text(value: str) -> bool:
    """A value holding Jinja markup is a template, not a name."""
    return "{{" in value or "{%" in value


@dataclass(frozen=True)
class TemplateChoice:
    """The template a run trains with, and where it came from (for notes, the cache's meta and the card)."""

    text: str  # the Jinja template
    key: Optional[str]  # "data.chat_template" or "data.fallback_chat_template"; None: the tokenizer's own
    label: str  # how it is named to a user: "chatml", "the tokenizer's own (DIR)", "a Jinja template"


def template_label(value: str) -> str:
    """How a configured template is named: its shipped name, its file, or "a Jinja template"."""
    if value in SHIPPED_TEMPLATES or not is_template_text(value):
        return value
    return "a Jinja template"


def choose_template(value: Optional[str], fallback: Optional[str], tokenizer_template: Optional[str],
                    tokenizer_name: str) -> TemplateChoice:
    """The template that trains: ``data.chat_template``, else the tokenizer's own, else the fallback.

    The model directory is the truth: a shipped experiment's template is only a
    fallback (``data.fallback_chat_template``) for a tokenizer without one; what the
    user names (``data.chat_template``) wins over both.

    Args:
        value: ``data.chat_template``.
        fallback: ``data.fallback_chat_template``.
        tokenizer_template: the tokenizer's own ``chat_template`` (None when it has none).
        tokenizer_name: the tokenizer's directory or ``byte-level``, for the message.

    Returns:
        The choice: its text, the key that named it (None: the tokenizer's own), its label.

    Raises:
        TemplateError: no template can be found, or a name names nothing; the message lists the shipped names.
    """
    if value:
        return TemplateChoice(_template_text(value, "data.chat_template"), "data.chat_template", template_label(value))
    if isinstance(tokenizer_template, str) and tokenizer_template.strip():
        return TemplateChoice(tokenizer_template, None, f"the tokenizer's own ({tokenizer_name})")
    if fallback:
        return TemplateChoice(_template_text(fallback, "data.fallback_chat_template"), "data.fallback_chat_template",
                              template_label(fallback))
    raise TemplateError(
        f"data.chat_template is unset and the tokenizer ({tokenizer_name}) has no chat template. "
        f"Set data.chat_template to a shipped name ({', '.join(sorted(SHIPPED_TEMPLATES))}), a Jinja template "
        "string, or a .jinja file.")


def resolve_template(value: Optional[str], tokenizer_template: Optional[str], tokenizer_name: str,
                     fallback: Optional[str] = None) -> str:
    """The template text that trains (:func:`choose_template`'s text)."""
    return choose_template(value, fallback, tokenizer_template, tokenizer_name).text


def _template_text(value: str, key: str) -> str:
    """The Jinja text a configured value (``key``'s) stands for: a shipped name, Jinja itself, or a file."""
    if value in SHIPPED_TEMPLATES:
        return SHIPPED_TEMPLATES[value]
    if is_template_text(value):
        return value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    raise TemplateError(
        f"{key}={value!r} is neither a shipped template ({', '.join(sorted(SHIPPED_TEMPLATES))}), a Jinja "
        "template (it holds no '{{' or '{%'), nor a file. Use one of those.")


class ChatTemplate:
    """A compiled chat template: renders a conversation once and says which characters an assistant wrote.

    Two ways to find the assistant spans, both from a single rendering:

    - the template marks them with ``{% generation %}`` (:attr:`marked`): the spans are
      exactly the marked blocks, as ``transformers``' ``return_assistant_tokens_mask``
      sees them (:meth:`render_marked`);
    - it does not (every stock template of a real model): :mod:`fsdp_workflow.data.spans`
      locates each assistant message's content in the rendering, followed by
      :attr:`end_of_turn`, the marker the template writes after an assistant turn
      (found once, by rendering a probe conversation).
    """

    def __init__(self, text: str) -> None:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        tracker: Dict[str, Any] = {"blocks": None, "spans": None}

        class Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}``: renders its body; records where it lands when tracking."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller: Callable[[], str]) -> str:
                rv = caller()
                if tracker["blocks"] is not None:  # the same bookkeeping as transformers' AssistantTracker
                    start = sum(len(b) for b in tracker["blocks"])
                    tracker["spans"].append((start, start + len(rv)))
                return rv

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise TemplateError(
                f"data.chat_template does not parse as Jinja (line {err.lineno}: {err.message})") from err
        self._tracker = tracker
        self.text = text
        self.marked = has_generation_markers(text)
        self._end_of_turn: Optional[str] = None
        self.header = ""  # what the template writes between a user message and the answer (set by end_of_turn)

    def render(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = False, **variables: Any) -> str:
        """The conversation as ``apply_chat_template(tokenize=False)`` renders it."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **_defaults(variables))

    def render_marked(self, messages: List[Dict[str, Any]], **variables: Any) -> Tuple[str, List[Tuple[int, int]]]:
        """Render once and return the text and the ``[start, end)`` of every ``{% generation %}`` block."""
        blocks: List[str] = []
        spans: List[Tuple[int, int]] = []
        self._tracker.update(blocks=blocks, spans=spans)
        try:
            for block in self._template.generate(messages=messages, add_generation_prompt=False,
                                                 **_defaults(variables)):
                blocks.append(block)
        finally:
            self._tracker.update(blocks=None, spans=None)
        return "".join(blocks), spans

    def end_of_turn(self, tokenizer: Any = None, **variables: Any) -> str:
        """What the template writes right after an assistant message's content, e.g. ``<|eot_id|>``.

        Found by rendering a probe conversation (user, assistant, user, assistant; with
        a system turn first if the template needs one): the marker is what follows
        an assistant turn both in the middle and at the end of a conversation
        (``<|im_end|>\\n<|im_start|>user`` and ``<|im_end|>\\n`` share ``<|im_end|>\\n``),
        less trailing whitespace (the newline between turns is layout, not something
        the model must say). Whitespace only is kept as it is.

        Args:
            tokenizer: compare whole tokens (``<|end|>\\n<|user|>`` and ``<|end|>\\n<|endoftext|>``
                share ``<|end|>\\n``, not ``<|end|>\\n<|``); None: characters.
            variables: what the template may read besides the messages (special tokens).

        Raises:
            TemplateError: the probe does not render, or the template writes nothing after an assistant turn.
        """
        if self._end_of_turn is not None:
            return self._end_of_turn
        u1, a1, u2, a2 = (f"\u2063{w}{n}\u2063" for w, n in (("qu", 1), ("an", 1), ("qu", 2), ("an", 2)))
        probe = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                 {"role": "user", "content": u2}, {"role": "assistant", "content": a2}]
        errors = []
        for messages in (probe, [{"role": "system", "content": "\u2063sys\u2063"}] + probe):
            try:
                text = self.render(messages, **variables)
            except Exception as err:  # noqa: BLE001 - a template may raise anything; the next probe may work
                errors.append(str(err))
                continue
            if not all(s in text for s in (u1, a1, u2, a2)):
                errors.append("the probe's messages do not all appear verbatim in its rendering")
                continue
            mid = text[text.index(a1) + len(a1):text.index(u2)]
            last = text[text.index(a2) + len(a2):]
            common = _common_tokens(mid, last, tokenizer)
            marker = common.rstrip() or common
            if not marker:
                raise TemplateError(
                    "the chat template writes nothing after an assistant turn, so a model trained on it never "
                    "learns to stop. Add the end-of-turn token after each assistant message (e.g. "
                    "'{{ message.content + eos_token }}'), or mark what to train with {% generation %}.")
            self._end_of_turn = marker
            self.header = text[text.index(u1) + len(u1):text.index(a1)]
            return marker
        raise TemplateError(
            "cannot find what the chat template writes after an assistant turn: a probe conversation "
            f"(user, assistant, user, assistant) does not render ({'; '.join(errors)}). "
            "Mark the assistant turns with {% generation %} ... {% endgeneration %}, or use another template.")


def _common_tokens(a: str, b: str, tokenizer: Any) -> str:
    """The longest common prefix of ``a`` and ``b`` made of whole tokens of ``tokenizer`` (characters if None)."""
    if tokenizer is None:
        return os.path.commonprefix([a, b])
    ea = tokenizer(a, add_special_tokens=False, return_offsets_mapping=True)
    eb = tokenizer(b, add_special_tokens=False)
    n = 0
    for x, y in zip(ea["input_ids"], eb["input_ids"]):
        if x != y:
            break
        n += 1
    return a[:ea["offset_mapping"][n - 1][1]] if n else ""


def _defaults(variables: Dict[str, Any]) -> Dict[str, Any]:
    """``apply_chat_template`` passes ``tools`` and ``documents`` (None) to every template."""
    return {"tools": None, "documents": None, **variables}


def has_generation_markers(text: str) -> bool:
    """Whether the template marks assistant turns with ``{% generation %}`` (transformers' own test)."""
    return re.search(r"\{\%-?\s*generation\s*-?\%\}", text) is not None


def compile_template(text: str) -> ChatTemplate:
    """Compile ``text`` in the environment ``apply_chat_template`` uses.

    Returns:
        The :class:`ChatTemplate`.

    Raises:
        TemplateError: the template does not parse.
    """
    return ChatTemplate(text)
