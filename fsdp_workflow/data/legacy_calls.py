"""OpenAI's legacy function calling, read as the tool calls and tool results it holds.

Before ``tool_calls`` (2023), OpenAI's chat format wrote a call as ``function_call``
on an assistant message and its result as a ``role: function`` message, and the
record's functions as ``functions`` (the fine-tuning format still accepts them)::

    {"functions": [{"name": "get_weather", "parameters": {...}}],
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": null,
                   "function_call": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}},
                  {"role": "function", "name": "get_weather", "content": "temp=22"},
                  {"role": "assistant", "content": "It is 22 C."}]}

Each is converted to today's shape before the template renders it, so every
template that renders ``tool_calls`` renders them: ``function_call`` becomes a
one-call ``tool_calls`` (the content beside it kept), ``role: function`` a
``tool`` message, ``functions`` the record's ``tools``. A legacy call has no id,
and Mistral's templates require one of 9 characters: the k-th legacy call of a
record is given ``call0000k`` (an id the record already uses is skipped), and
the result that answers it (the first ``function`` or id-less ``tool`` message
after it, by name when the result names one) the same ``tool_call_id``.

What cannot be read this way is refused, naming the legacy format: never a
call or a result dropped.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Set

from fsdp_workflow.data.messages import MessageError

LEGACY = "OpenAI's legacy function-calling format"
_CALL_SHAPE = '{"name": ..., "arguments": "{...}"}'


def _where(n: int, role: Any) -> str:
    return f"messages[{n}] ({role})"


def _used_ids(raw: List[Any]) -> Set[str]:
    ids = set()
    for m in raw:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        for c in calls if isinstance(calls, list) else ():
            if isinstance(c, dict) and isinstance(c.get("id"), str):
                ids.add(c["id"])
    return ids


def _call(m: Dict[str, Any], n: int, role: Any, call_id: str) -> Dict[str, Any]:
    """The assistant message ``m`` with its ``function_call`` as a one-call ``tool_calls``."""
    if role != "assistant":
        raise MessageError(f"{_where(n, role)}: a function_call ({LEGACY}) on a {role!r} message; only an "
                           "assistant message calls a function. Fix the role or remove the call")
    if m.get("tool_calls"):
        raise MessageError(f"{_where(n, role)}: both function_call ({LEGACY}) and tool_calls; give the call once, "
                           "as tool_calls")
    fc = m["function_call"]
    if not isinstance(fc, dict) or not isinstance(fc.get("name"), str) or not fc["name"]:
        raise MessageError(f"{_where(n, role)}: function_call ({LEGACY}) is {fc!r:.80}, not {_CALL_SHAPE}")
    args = fc.get("arguments", {})
    if isinstance(args, str):  # the legacy format writes them as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            raise MessageError(f"{_where(n, role)}: function_call ({LEGACY}) to {fc['name']!r} has arguments "
                               f"that are not JSON ({err.msg} at column {err.pos + 1}): {args[:80]!r}. Write them "
                               "as a JSON object") from err
    fn = {"name": fc["name"], "arguments": args}  # not an object: refused with tool_calls' own check
    rest = {k: v for k, v in m.items() if k != "function_call"}
    return {**rest, "tool_calls": [{"id": call_id, "type": "function", "function": fn}]}


def convert(raw: List[Any], role_key: str) -> List[Any]:
    """The messages with legacy calls and results in today's shape (others as they are).

    Args:
        raw: the record's messages as read.
        role_key: the dataset's name for the role (``data.fields.role``).

    Returns:
        The messages, legacy ones converted (new dicts; ``raw`` is not changed).

    Raises:
        MessageError: a legacy call or result that cannot be read as one (``messages[N]`` and why).
    """
    if not any(isinstance(m, dict) and (m.get("function_call") is not None or m.get(role_key) == "function")
               for m in raw):
        return raw
    used = _used_ids(raw)
    pending: List[Dict[str, str]] = []  # legacy calls not yet answered, oldest first: {"id", "name"}
    any_call = False  # an assistant message before this one calls a tool (either shape)
    count = 0
    out: List[Any] = []
    for n, m in enumerate(raw):
        if not isinstance(m, dict):
            out.append(m)
            continue
        role = m.get(role_key)
        if m.get("function_call") is not None:
            count += 1
            while f"call{count:05d}" in used:
                count += 1
            m = _call(m, n, role, f"call{count:05d}")
            pending.append({"id": f"call{count:05d}", "name": m["tool_calls"][0]["function"]["name"]})
        elif "function_call" in m:  # an API dump writes "function_call": null on every message
            m = {k: v for k, v in m.items() if k != "function_call"}
        if role == "function" or (role == "tool" and not m.get("tool_call_id") and pending):
            m = _result(m, n, role, role_key, pending, any_call)
        any_call = any_call or bool(m.get("tool_calls"))
        out.append(m)
    return out


def _result(m: Dict[str, Any], n: int, role: Any, role_key: str, pending: List[Dict[str, str]],
            any_call: bool) -> Dict[str, Any]:
    """A ``function`` (or id-less ``tool``) message as the ``tool`` result of the legacy call it answers."""
    name = m.get("name")
    if role == "function" and (not isinstance(name, str) or not name):
        raise MessageError(f"{_where(n, role)}: a function result ({LEGACY}) without the 'name' of the function "
                           "it answers; add it")
    match: Optional[Dict[str, str]] = next((p for p in pending if p["name"] == name), None) if name else \
        (pending[0] if pending else None)
    if match is None and role == "function" and not any_call:
        raise MessageError(f"{_where(n, role)}: a result of {name!r} ({LEGACY}), but no assistant message before "
                           "it calls a function (function_call or tool_calls): the conversation would answer a "
                           "call that is not there. Add the call, or leave the record out")
    out = {**m, role_key: "tool"}
    if match is not None:
        pending.remove(match)
        out["tool_call_id"] = match["id"]
        out.setdefault("name", match["name"])
    return out


def record_functions(record: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """The record's legacy ``functions`` as ``tools`` (None when it has none).

    Raises:
        MessageError: ``functions`` is not a list of function schemas, or the record has ``tools`` too.
    """
    functions, tools = record.get("functions"), record.get("tools")
    if functions is None or isinstance(functions, list) and not functions:
        return None
    if tools is not None and not (isinstance(tools, (list, str)) and not tools):
        raise MessageError(f"both tools and functions ({LEGACY}); give the schemas once, as tools")
    if not isinstance(functions, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                  for f in functions):
        raise MessageError(f"functions ({LEGACY}): a {type(functions).__name__}, not a list of function schemas "
                           "({'name', 'description', 'parameters'})")
    return [{"type": "function", "function": f} for f in functions]
