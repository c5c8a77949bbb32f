"""One chat message as it comes -> the message the chat template reads.

What exports write, normalised before rendering (the template then renders it
as ``apply_chat_template`` would):

- ``content`` as a list of parts (``[{"type": "text", "text": ...}]``, the OpenAI
  shape): the text parts joined with a newline (as vLLM joins them). Any other
  part (``image_url``, ``input_audio``, ...) is refused: multimodal training does
  not exist here, and dropping the part would train the answer without what it answers.
- ``tool_calls`` on an assistant message, OpenAI's ``{"type": "function",
  "function": {"name", "arguments"}}`` or flat ``{"name", "arguments"}``. Arguments
  given as a JSON string are parsed to an object: Llama 3.x and Qwen2.5 write
  ``arguments | tojson``, which would write a string twice-quoted.
- ``content: null`` (or absent, or empty) beside ``tool_calls`` becomes ``""``:
  Qwen3's template fails on null inside transformers itself.
- ``tool`` messages (tool results) keep ``tool_call_id`` and ``name``.
- ShareGPT ``from``/``value``: ``human``->user, ``gpt``->assistant, ``system``,
  ``tool`` and ``observation``->tool, ``function_call``->an assistant message whose
  value is the call ``{"name", "arguments"}`` (LLaMA-Factory's spelling).

A reason raised here starts with ``messages[N]`` so that prepare does not offer a
field mapping as its fix (:data:`fsdp_workflow.data.formats.FIELD_PROBLEMS`).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool", "observation": "tool", "function_call": "assistant"}
_KEPT = ("tool_call_id", "name")  # what a tool message carries besides its content


class MessageError(ValueError):
    """A message cannot be rendered; the reason names it (``messages[N] (role)``) and the fix."""


def _where(n: int, role: str) -> str:
    return f"messages[{n}] ({role})"


def join_parts(content: Any, n: int, role: str) -> Any:
    """``content`` as a string when it is a list of parts; anything else as it is.

    Raises:
        MessageError: a part is not text (image, audio, file, ...), or not an object.
    """
    if not isinstance(content, list):
        return content
    texts: List[str] = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        raise MessageError(
            f"{_where(n, role)}: content part {k} is of type {kind!r}; only text parts "
            "({'type': 'text', 'text': ...}) can be trained (multimodal training is not built). "
            "Remove the part or the record")
    return "\n".join(texts)


def _tool_calls(raw: Any, n: int) -> List[Dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise MessageError(f"{_where(n, 'assistant')}: tool_calls is a {type(raw).__name__}, not a non-empty list "
                           "of calls ({'type': 'function', 'function': {'name': ..., 'arguments': {...}}})")
    calls: List[Dict[str, Any]] = []
    for k, call in enumerate(raw):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MessageError(f"{_where(n, 'assistant')}: tool_calls[{k}] has no function name "
                               "(expected {'function': {'name': ..., 'arguments': ...}} or {'name', 'arguments'})")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                raise MessageError(f"{_where(n, 'assistant')}: tool_calls[{k}] ({fn['name']}) arguments are a "
                                   f"string that is not JSON ({err.msg} at column {err.pos + 1}): "
                                   f"{args[:80]!r}. Write them as a JSON object") from err
        if not isinstance(args, dict):
            raise MessageError(f"{_where(n, 'assistant')}: tool_calls[{k}] ({fn['name']}) arguments are a "
                               f"{type(args).__name__}, not an object")
        fn = {**fn, "arguments": args}
        calls.append({**call, "function": fn} if "function" in call else fn)
    return calls


def call_names(message: Dict[str, Any]) -> List[str]:
    """The function names an assistant message calls (none: no ``tool_calls``)."""
    return [c.get("function", c)["name"] for c in message.get("tool_calls") or ()]


def normalise(m: Dict[str, Any], role: str, content: Any, n: int, content_key: str) -> Dict[str, Any]:
    """The message ``{"role", "content", ...}`` the template reads.

    Args:
        m: the message as read (its other keys: tool_calls, reasoning_content, tool_call_id, name).
        role: its role, already mapped and checked.
        content: its content as read (a string, a list of parts, None).
        n: its index, for messages.
        content_key: the dataset's name for the content (``data.fields.content``), for messages.

    Raises:
        MessageError: the message cannot be rendered; the reason says why and the fix.
    """
    content = join_parts(content, n, role)
    calls: Optional[List[Dict[str, Any]]] = None
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = _tool_calls(m["tool_calls"], n)
        if content is None:
            content = ""
    if not isinstance(content, str):
        got = "null" if content is None else f"a {type(content).__name__}"
        raise MessageError(f"{_where(n, role)}: {content_key!r} is {got}, not a string or a list of text parts"
                           + (" (an assistant turn needs content or tool_calls)" if role == "assistant" else ""))
    if role == "assistant" and not calls and not content.strip():
        raise MessageError(f"{_where(n, role)} is an empty assistant turn (no content, no tool_calls)")
    out: Dict[str, Any] = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        out.update({k: m[k] for k in _KEPT if isinstance(m.get(k), str)})
    reasoning = m.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        out["reasoning_content"] = reasoning
    return out


def sharegpt(m: Dict[str, Any], n: int) -> Dict[str, Any]:
    """A ShareGPT ``{from, value}`` message as ``{role, content, ...}`` (before :func:`normalise`)."""
    who = m["from"]
    role = SHAREGPT_ROLES.get(who, who)
    value = m.get("value")
    if who == "function_call":
        try:
            call = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as err:
            raise MessageError(f"{_where(n, 'function_call')}: value is not JSON ({err.msg}); a ShareGPT "
                               "function_call holds {\"name\": ..., \"arguments\": {...}}") from err
        calls = call if isinstance(call, list) else [call]
        return {**m, "role": role, "content": None, "tool_calls": calls}
    return {**m, "role": role, "content": value}


def record_tools(record: Dict[str, Any]) -> Optional[List[Any]]:
    """The record's ``tools`` (a list, or a JSON string of one, as LLaMA-Factory writes it); None when absent.

    Raises:
        MessageError: ``tools`` is neither.
    """
    tools = record.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise MessageError(f"tools: a string that is not JSON ({err.msg}); give a list of tool schemas") from err
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise MessageError(f"tools: a {type(tools).__name__}, not a list of tool schemas "
                           "({'type': 'function', 'function': {'name', 'description', 'parameters'}})")
    return tools


def tool_names(tools: List[Dict[str, Any]]) -> List[str]:
    """The names of the tools a record declares."""
    names = []
    for t in tools:
        fn = t.get("function", t)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names
