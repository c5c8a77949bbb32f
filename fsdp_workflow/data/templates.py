"""Chat templates: the shipped ones, resolving ``data.chat_template``, rendering.

``data.chat_template`` is one of:

- unset: the tokenizer's own ``chat_template``;
- a shipped name (:data:`SHIPPED_TEMPLATES`, e.g. ``chatml``);
- a Jinja template string (it contains ``{{`` or ``{%``) or the path of a ``.jinja`` file.

The shipped templates mark each assistant turn with ``{% generation %}`` so
that ``transformers``' ``return_assistant_tokens_mask`` works with them; the
prepare step does not need the markers (it finds assistant spans by rendering
prefixes, :func:`fsdp_workflow.data.formats.conversation_spans`), and the
shipped templates are written so that both give the same span: the assistant
content plus its end-of-turn marker.

Rendering uses the environment ``transformers`` uses for ``apply_chat_template``
(sandboxed Jinja, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, a ``tojson`` that does not escape HTML). This module
imports neither torch nor transformers (jinja2 only when rendering), so
planning can list :data:`SHIPPED_TEMPLATES`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional

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


def resolve_template(value: Optional[str], tokenizer_template: Optional[str], tokenizer_name: str) -> str:
    """The template text ``data.chat_template`` stands for.

    Args:
        value: ``data.chat_template``.
        tokenizer_template: the tokenizer's own ``chat_template`` (None when it has none).
        tokenizer_name: the tokenizer's directory or ``byte-level``, for the message.

    Returns:
        The Jinja template text.

    Raises:
        TemplateError: no template can be found; the message lists the shipped names.
    """
    shipped = ", ".join(sorted(SHIPPED_TEMPLATES))
    if value is None or value == "":
        if isinstance(tokenizer_template, str) and tokenizer_template.strip():
            return tokenizer_template
        raise TemplateError(
            f"data.chat_template is unset and the tokenizer ({tokenizer_name}) has no chat template. "
            f"Set data.chat_template to a shipped name ({shipped}), a Jinja template string, or a .jinja file.")
    if value in SHIPPED_TEMPLATES:
        return SHIPPED_TEMPLATES[value]
    if is_template_text(value):
        return value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    raise TemplateError(
        f"data.chat_template={value!r} is neither a shipped template ({shipped}), a Jinja template "
        "(it holds no '{{' or '{%'), nor a file. Use one of those.")


Renderer = Callable[..., str]


def compile_template(text: str) -> Renderer:
    """Compile ``text`` in the environment ``apply_chat_template`` uses.

    Returns:
        ``render(messages, add_generation_prompt=False, **variables) -> str``.

    Raises:
        TemplateError: the template does not parse.
    """
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (spans are found by prefixes)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

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
        template = env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise TemplateError(f"data.chat_template does not parse as Jinja (line {err.lineno}: {err.message})") from err

    def render(messages: List[Dict[str, Any]], add_generation_prompt: bool = False, **variables: Any) -> str:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    return render
