"""Tool calls in one rendering: what the assistant wrote when it called a tool, and templates that cannot say it.

A stock template writes a call in its own syntax (Qwen's ``<tool_call>\\n{...}\\n</tool_call>``,
Mistral's ``[TOOL_CALLS] [...]``, Llama 3.1's bare ``{"name": ..., "parameters": ...}``),
so the call cannot be looked up as the message's content is. Instead the
conversation is rendered a second time with that one assistant message replaced
by a plain probe answer: everything the two renderings share before the probe
is the template's text before the turn, everything they share after it is the
rest of the conversation, and what lies between, in the real rendering, is what
the assistant wrote (content, the call, the template's call syntax), followed by
the end-of-turn marker. That span is trained as assistant output. Tool results
and the tool list are the template's text around it, never trained.

A template that renders a record's tools, calls or tool results not at all
(``chatml`` shipped, Gemma's, Phi's, any template without ``tool_calls``) would
train the answer without the call it rests on, so the record is refused, naming
``data.chat_template`` (:class:`ToolsNotRendered`): never silently dropped.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from fsdp_workflow.data.messages import call_names, tool_names

PROBE = "\u2063probe\u2063"  # invisible separators: never in real data
FIX = ("Set data.chat_template to a template that renders tools (unset: the model's own; the stock Llama 3.1+, "
       "Qwen2.5/Qwen3 and Mistral templates do), or leave records with tools out of this data")


class ToolsNotRendered(ValueError):
    """The chat template drops a record's tools, tool calls or tool results; the message names the fix."""


def has_tool_calls(messages: List[Dict[str, Any]]) -> bool:
    """Whether any assistant message calls a tool."""
    return any(m.get("tool_calls") for m in messages)


def check_support(text: str, messages: List[Dict[str, Any]], tools: Optional[List[Any]]) -> None:
    """Refuse, before rendering, a record with calls or tools for a template that never reads them.

    Raises:
        ToolsNotRendered: the template's text never mentions ``tool_calls`` (or ``tools``).
    """
    if has_tool_calls(messages) and "tool_calls" not in text:
        raise ToolsNotRendered(f"the chat template (data.chat_template) cannot render tool calls (it never reads "
                               f"message.tool_calls), and this record calls {_first_call(messages)!r}. {FIX}")
    if tools and "tools" not in text:
        raise ToolsNotRendered(f"the chat template (data.chat_template) cannot render the record's tools (it never "
                               f"reads 'tools'). {FIX}")


def _first_call(messages: List[Dict[str, Any]]) -> str:
    return next(name for m in messages for name in call_names(m))


def check_rendered(full: str, messages: List[Dict[str, Any]], tools: Optional[List[Any]],
                   spans: List[Tuple[int, int]]) -> None:
    """Refuse a rendering that lost a tool, a call (from the trained text) or a tool result.

    Args:
        full: the rendering.
        messages: the conversation.
        tools: the record's tools.
        spans: the trained spans of the assistant turns, in order (for a marked template: its blocks).

    Raises:
        ToolsNotRendered: something the record holds is not in the rendering; the message says what.
    """
    trained = "".join(full[a:b] for a, b in spans)
    for n, m in enumerate(messages):
        for name in call_names(m):
            if name not in trained:
                raise ToolsNotRendered(f"the chat template (data.chat_template) does not write messages[{n}]'s call "
                                       f"to {name!r} in the assistant's turn, so it would not be trained. {FIX}")
        if m["role"] == "tool" and m["content"].strip():
            escaped = json.dumps(m["content"], ensure_ascii=False)[1:-1]
            if m["content"].strip() not in full and escaped.strip() not in full:
                raise ToolsNotRendered(f"the chat template (data.chat_template) drops messages[{n}]'s tool result. "
                                       f"{FIX}")
    for name in tool_names(tools or []):
        if name not in full:
            raise ToolsNotRendered(f"the chat template (data.chat_template) does not write the record's tool "
                                   f"{name!r}. {FIX}")


def tool_call_spans(full: str, messages: List[Dict[str, Any]], render: Callable[..., str], eot: str,
                    header: str = "") -> Dict[int, Tuple[int, int]]:
    """``{index: (start, end)}`` of each assistant message with ``tool_calls`` in ``full``.

    Args:
        full: the rendering of ``messages``.
        messages: the conversation.
        render: renders a conversation as ``full`` was rendered (same tools, same variables).
        eot: the template's end-of-turn marker, included when the template writes it after the call.
        header: what the template writes before an answer (the fallback below skips it).

    Raises:
        ToolsNotRendered: the turn cannot be told apart.
    """
    out: Dict[int, Tuple[int, int]] = {}
    floor = 0  # the end of the previous assistant turn: a call starts after it
    for n, m in enumerate(messages):
        if not m.get("tool_calls"):
            if m["role"] == "assistant" and m["content"].strip():
                i = full.find(m["content"].strip(), floor)
                floor = i + len(m["content"].strip()) if i >= 0 else floor
            continue
        span = _probe_span(full, messages, n, render, eot)
        if span is None:
            span = _prefix_span(full, messages, n, render, eot, header, floor)
        out[n] = span
        floor = span[1]
    return out


def _probe_span(full: str, messages: List[Dict[str, Any]], n: int, render: Callable[..., str],
                eot: str) -> Optional[Tuple[int, int]]:
    """The turn as the difference from a rendering with a plain probe answer in its place (None: no such rendering).

    Mistral's templates refuse a plain answer followed by a tool result (roles must alternate).
    """
    probe = {k: v for k, v in messages[n].items() if k not in ("tool_calls", "content")}
    probe["content"] = PROBE
    try:
        other = render(messages[:n] + [probe] + messages[n + 1:])
    except Exception:  # noqa: BLE001 - a template is user code; the fallback decides
        return None
    p = other.find(PROBE)
    if p < 0:
        return None
    start = len(os.path.commonprefix([full, other[:p]]))
    tail = other[p + len(PROBE):]
    shared = len(os.path.commonprefix([full[::-1], tail[::-1]])) if tail else 0
    end = len(full) - min(shared, len(full) - start)
    if eot and full.startswith(eot, end):
        end += len(eot)
    return start, end


def _prefix_span(full: str, messages: List[Dict[str, Any]], n: int, render: Callable[..., str], eot: str,
                 header: str, floor: int) -> Tuple[int, int]:
    """The turn as what follows the rendering of the conversation before it, up to the end-of-turn marker.

    Raises:
        ToolsNotRendered: the conversation before the turn does not render, or no marker follows the call.
    """
    where = f"cannot find messages[{n}]'s tool call in the rendering"
    try:
        before = render(messages[:n], add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template is user code
        raise ToolsNotRendered(f"{where}: the conversation before it does not render ({err}). {FIX}") from err
    start = len(os.path.commonprefix([full, before]))
    prev = messages[n - 1]["content"].strip() if n else ""
    at = full.find(prev, floor) if prev else -1
    if start < floor or (at >= 0 and start < at + len(prev)):  # the prefix renders differently further up
        start = max(floor, at + len(prev) if at >= 0 else floor)
        mark = header.strip()
        if mark and full.startswith(mark, start):
            start += len(mark)
    end = full.find(eot, start) if eot else -1
    if end < 0:
        raise ToolsNotRendered(f"{where}: the end-of-turn marker {eot!r} does not follow it. {FIX}")
    return start, end + len(eot)
