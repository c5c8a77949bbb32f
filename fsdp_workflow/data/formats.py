"""Records -> documents: the text to tokenise and the character spans that carry loss.

One function per ``data.format``; each returns a :class:`Document` or raises
:class:`BadRecord` (a record lacking the mapped fields, with an unknown role,
an empty assistant turn, or no assistant turn at all).

- ``text``: the text field; every token trained, EOS appended when ``data.add_eos``.
- ``conversation``: ``messages: [{role, content}]`` or ShareGPT
  ``conversations: [{from, value}]`` (``human``->user, ``gpt``->assistant),
  rendered once by the chat template. The trained spans are its
  ``{% generation %}`` blocks, or, for a template without them, each assistant
  message's content plus the end-of-turn marker, found in that one rendering
  (:mod:`fsdp_workflow.data.spans`). An assistant message may carry
  ``reasoning_content``; it is passed to the template, which decides whether
  to write it.
- ``prompt_completion`` / ``alpaca``: with a chat template, a [user, assistant]
  conversation (plus the ``system`` field when the record has one, and for
  ``alpaca`` LLaMA-Factory's ``history`` of earlier [instruction, response]
  turns before it, refused without a template); without,
  plain concatenation (the classic Alpaca prompt for ``alpaca``) and the
  answer followed by EOS is trained.

``data.train_on`` then picks the spans: every assistant span, the last one, or
the whole document (``all``). An assistant message with OpenAI's ``"weight": 0``
is rendered but not trained (``all`` trains every token regardless).

OpenAI's legacy ``function_call``, ``role: function`` and ``functions`` are read as
the tool calls, results and tools they are (:mod:`fsdp_workflow.data.legacy_calls`).
A trained answer with no user turn before it (an empty prompt, a conversation of
system and assistant turns, preference data's chosen answers mapped without their
prompt) is a bad record unless ``data.allow_no_user``; preference data
(``prompt``/``chosen``/``rejected``) is named as such, with the routes that train it
(:mod:`fsdp_workflow.data.preference`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from fsdp_workflow.config.schema import DataFormat, TrainOn
from fsdp_workflow.data import legacy_calls
from fsdp_workflow.data.messages import ROLES, MessageError, call_names, normalise, record_tools, sharegpt
from fsdp_workflow.data.preference import is_preference, preference_advice
from fsdp_workflow.data.spans import SpanNotFound, assistant_spans
from fsdp_workflow.data.tools import ToolsNotRendered, check_rendered, check_support, has_tool_calls, tool_call_spans
from fsdp_workflow.data.templates import ChatTemplate

SHAREGPT_KEY = "conversations"

ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


class BadRecord(ValueError):
    """One record cannot be used; the message says why (the caller adds file and line)."""


@dataclass
class Document:
    """A record ready to tokenise."""

    text: str
    spans: List[Tuple[int, int]]  # [start, end) character spans that carry loss
    eos: bool  # append the EOS token after the text
    eos_trained: bool  # ... and train it


@dataclass(frozen=True)
class FormatSpec:
    """What turns records into documents (picklable: every worker gets one)."""

    format: DataFormat
    text_field: str
    fields: Mapping[str, str]
    train_on: TrainOn
    add_eos: bool
    template: Optional[str]  # the resolved template text; None: plain concatenation
    allow_no_user: bool = False  # data.allow_no_user: train answers that no user turn precedes

    def field(self, canonical: str) -> str:
        """The dataset's name for a canonical field (``data.fields``)."""
        return self.fields.get(canonical, canonical)


# How the reasons below begin when a record lacks (or mis-types) a mapped field: the problems a field
# mapping (data.text_field, data.fields.*) fixes, and the only ones prepare's report suggests it for.
FIELD_PROBLEMS = ("no field", "field ", "message ")


def parse_json_line(line: str) -> Any:
    """One JSON line as a Python value."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        # One JSON line: an error past its end (a line cut off) is at the column after its last character;
        # json itself would count the kept newline and say "line 2, column 1".
        column = min(err.pos, len(line.rstrip("\r\n"))) + 1
        msg = err.msg[:-3] if err.msg.endswith(" at") else err.msg  # "Invalid control character at"
        raise BadRecord(f"not valid JSON ({msg} at column {column})") from err


def _get_str(record: Mapping[str, Any], key: str, canonical: str, required: bool = True) -> str:
    if key not in record or record[key] is None:
        if not required:
            return ""
        if canonical == "text":  # format=text reads data.text_field (the planner refuses data.fields there)
            raise BadRecord(f"no field {key!r} (data.text_field={key!r}); fields: {sorted(record)[:12]}. "
                            "Name the field holding the text with data.text_field=NAME")
        mapped = "" if key == canonical else f" (data.fields.{canonical}={key!r})"
        raise BadRecord(f"no field {key!r}{mapped}; fields: {sorted(record)[:12]}. Map it with data.fields.{canonical}")
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} is a {type(value).__name__}, not a string")
    return value


def _messages(record: Mapping[str, Any], spec: FormatSpec) -> List[Dict[str, Any]]:
    key = spec.field("messages")
    raw = record.get(key)
    if raw is None and key == "messages":
        raw = record.get(SHAREGPT_KEY)
    if raw is None:
        if is_preference(record):  # a field mapping would train the answers without their prompt
            raise BadRecord(preference_advice(record, spec.format, spec.fields))
        raise BadRecord(f"no field {key!r} (nor ShareGPT {SHAREGPT_KEY!r}); fields: {sorted(record)[:12]}. "
                        "Map it with data.fields.messages")
    if not isinstance(raw, list) or not raw:
        raise BadRecord(f"field {key!r} is not a non-empty list of messages"
                        + (f"; {preference_advice(record, spec.format, spec.fields)}"
                           if is_preference(record) else ""))
    role_key, content_key = spec.field("role"), spec.field("content")
    try:
        raw = legacy_calls.convert(raw, role_key)
    except MessageError as err:
        raise BadRecord(str(err)) from err
    out: List[Dict[str, Any]] = []
    for n, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRecord(f"message {n} is a {type(m).__name__}, not an object")
        try:
            if role_key not in m and "from" in m:  # ShareGPT spelling
                m = sharegpt(m, n)
                role, content, ckey = m["role"], m["content"], "value"
            else:
                if role_key not in m:
                    raise BadRecord(f"message {n} has no {role_key!r} (fields: {sorted(m)}). "
                                    "Map it with data.fields.role")
                if content_key not in m and "tool_calls" not in m:
                    raise BadRecord(f"message {n} ({m[role_key]}) has no {content_key!r} (fields: {sorted(m)}). "
                                    "Map it with data.fields.content")
                role, content, ckey = m[role_key], m.get(content_key), content_key
            if role not in ROLES:
                raise BadRecord(f"message {n} has unknown role {role!r}; known: {', '.join(ROLES)} "
                                "(ShareGPT: human, gpt, system, tool, observation, function_call; OpenAI's "
                                "legacy: function)")
            message = normalise(m, role, content, n, ckey)
            if "weight" in m:
                message["weight"] = _weight(m["weight"], n, role)
            out.append(message)
        except MessageError as err:
            raise BadRecord(str(err)) from err
    system = record.get(spec.field("system"))
    if isinstance(system, str) and system.strip() and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no assistant turn: nothing to train")
    return out


def _weight(value: Any, n: int, role: str) -> int:
    """OpenAI's per-message ``weight``: 0 leaves an assistant message untrained, 1 trains it."""
    if role != "assistant":
        raise BadRecord(f"message {n} ({role}) has a weight: weights mark assistant messages only (OpenAI's "
                        "fine-tuning format); remove it")
    if value not in (0, 1):  # 0, 1 (and false, true)
        raise BadRecord(f"message {n} (assistant) has weight {value!r}: 0 (not trained) or 1 (trained), as "
                        "OpenAI's fine-tuning format defines it")
    return int(value)


def _history(record: Mapping[str, Any], spec: FormatSpec) -> List[Dict[str, Any]]:
    """LLaMA-Factory's alpaca ``history``: earlier ``[instruction, response]`` turns, as user/assistant messages."""
    key = spec.field("history")
    raw = record.get(key)
    if raw is None or isinstance(raw, list) and not raw:
        return []
    if not isinstance(raw, list):
        raise BadRecord(f"field {key!r} is a {type(raw).__name__}, not a list of [instruction, response] pairs")
    out: List[Dict[str, Any]] = []
    for n, turn in enumerate(raw):
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise BadRecord(f"field {key!r}: turn {n} is {turn!r:.80}, not an [instruction, response] "
                            "pair of strings")
        if not turn[1].strip():
            raise BadRecord(f"field {key!r}: turn {n} has an empty response")
        out += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    return out


def conversation_spans(messages: List[Dict[str, Any]], template: ChatTemplate, variables: Mapping[str, Any],
                       tools: Optional[List[Any]] = None) -> Tuple[str, List[Tuple[int, int]]]:
    """Render ``messages`` once and find the characters each assistant turn contributes.

    Args:
        messages: the normalised conversation.
        template: the compiled chat template.
        variables: what the template may read besides the messages (special tokens).
        tools: the record's tool schemas, passed to the template as ``tools`` (None: none).

    Returns:
        The rendered text and the ``[start, end)`` spans to train, in order: the
        ``{% generation %}`` blocks when the template has them, else one span per
        assistant message (its content plus the end-of-turn marker, :mod:`fsdp_workflow.data.spans`;
        a tool call: what the template wrote for the turn, :mod:`fsdp_workflow.data.tools`).

    Raises:
        BadRecord: the template refuses the conversation (it raised), drops its tools, calls or tool
            results, or an assistant turn is not in the rendering.
    """
    variables = {**variables, "tools": tools} if tools else variables
    try:
        check_support(template.text, messages, tools)
    except ToolsNotRendered as err:
        raise BadRecord(str(err)) from err
    try:
        if template.marked:
            full, spans = template.render_marked(messages, **variables)
        else:
            full = template.render(messages, **variables)
    except Exception as err:  # noqa: BLE001 - a template is user code: whatever it raises is about this record
        raise BadRecord(f"the chat template refused this conversation ({type(err).__name__}: {err})") from err
    try:
        if not template.marked:
            eot = template.end_of_turn(None, **variables)
            known = (tool_call_spans(full, messages, lambda ms, **kw: template.render(ms, **kw, **variables), eot,
                                     template.header)
                     if has_tool_calls(messages) else None)
            spans = assistant_spans(full, messages, eot, template.header, known)
        if tools or has_tool_calls(messages):
            check_rendered(full, messages, tools, spans)
    except (SpanNotFound, ToolsNotRendered) as err:
        raise BadRecord(str(err)) from err
    return full, spans


def _pick(spans: List[Tuple[int, int]], train_on: TrainOn) -> List[Tuple[int, int]]:
    return spans[-1:] if train_on == TrainOn.last_assistant else spans


def to_document(record: Any, spec: FormatSpec, render: Optional[ChatTemplate],
                variables: Mapping[str, Any]) -> Document:
    """Turn one record into a :class:`Document`.

    Args:
        record: a dict (JSON, Parquet, datasets) or a text block (text source).
        spec: the format settings.
        render: the compiled chat template (None: plain formats).
        variables: what the template may read besides the messages (special tokens).

    Raises:
        BadRecord: the record is unusable (see the module docstring).
    """
    if spec.format == DataFormat.text:
        text = record if isinstance(record, str) else _get_str(_as_dict(record), spec.text_field, "text")
        if not isinstance(record, str):
            text = str(text)
        return Document(text, [(0, len(text))], spec.add_eos, True)
    rec = _as_dict(record)
    system = rec.get(spec.field("system"))
    if spec.format == DataFormat.conversation:
        messages = _messages(rec, spec)
        try:
            functions = legacy_calls.record_functions(rec)
            tools = functions if functions is not None else record_tools(rec)
        except MessageError as err:
            raise BadRecord(str(err)) from err
        return _templated(messages, spec, render, variables, tools, rec)
    else:
        history: List[Dict[str, Any]] = []  # alpaca's earlier turns
        if spec.format == DataFormat.prompt_completion:
            prompt_raw, completion_raw = rec.get(spec.field("prompt")), rec.get(spec.field("completion"))
            if isinstance(prompt_raw, list) and isinstance(completion_raw, list):  # conversational prompt/completion
                messages = _messages({spec.field("messages"): prompt_raw + completion_raw,
                                      spec.field("system"): system}, spec)
                return _templated(messages, spec, render, variables, record=rec)
            if completion_raw is None and is_preference(rec):
                raise BadRecord(preference_advice(rec, spec.format, spec.fields))
            prompt = _get_str(rec, spec.field("prompt"), "prompt")
            answer = _get_str(rec, spec.field("completion"), "completion")
            user = prompt
        else:
            instruction = _get_str(rec, spec.field("instruction"), "instruction")
            extra = _get_str(rec, spec.field("input"), "input", required=False)
            answer = _get_str(rec, spec.field("output"), "output")
            prompt = (ALPACA_PROMPT.format(instruction=instruction, input=extra) if extra.strip()
                      else ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
            user = instruction + ("\n\n" + extra if extra.strip() else "")
            history = _history(rec, spec)
            if history and render is None:
                raise BadRecord(f"{len(history) // 2} earlier turn(s) in {spec.field('history')!r}, which the plain "
                                "Alpaca prompt has no place for: set data.chat_template (e.g. chatml) to render them "
                                "as earlier turns of the conversation")
        if not answer.strip():
            raise BadRecord("empty " + ("completion" if spec.format == DataFormat.prompt_completion else "output"))
        if render is None and not user.strip() and not spec.allow_no_user:
            what = "prompt" if spec.format == DataFormat.prompt_completion else "instruction and input"
            raise BadRecord(f"empty {what}: the answer would be trained as an answer to no question. "
                            + _no_user_fix(rec, spec))
        if render is None:
            text = prompt + answer
            if spec.train_on == TrainOn.all:
                return Document(text, [(0, len(text))], True, True)
            return Document(text, [(len(prompt), len(text))], True, True)
        messages = [*history, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if isinstance(system, str) and system.strip():
            messages.insert(0, {"role": "system", "content": system})
    return _templated(messages, spec, render, variables, record=rec)


def _no_user_fix(record: Mapping[str, Any], spec: FormatSpec) -> str:
    if is_preference(record):
        return preference_advice(record, spec.format, spec.fields)
    return ("Give the record its question (a user turn, a prompt), or set data.allow_no_user=true if answers "
            "without one are meant (e.g. a system prompt and its answer)")


def _refuse_unasked(messages: List[Dict[str, Any]], weights: List[int], spec: FormatSpec,
                    record: Mapping[str, Any]) -> None:
    """Refuse a trained assistant turn that no (non-empty) user turn precedes, unless data.allow_no_user."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trained = answers if spec.train_on == TrainOn.all else [i for i, w in zip(answers, weights) if w]
    if spec.allow_no_user or not trained:
        return
    first = trained[-1] if spec.train_on == TrainOn.last_assistant else trained[0]
    if any(m["role"] == "user" and m["content"].strip() for m in messages[:first]):
        return
    said = messages[first]["content"].strip() or f"a call to {call_names(messages[first])[0]}"
    raise BadRecord(f"no user turn before the assistant turn {said!r:.60}: it would be trained as an answer to "
                    f"no question. {_no_user_fix(record, spec)}")


def _templated(messages: List[Dict[str, Any]], spec: FormatSpec, render: Optional[ChatTemplate],
               variables: Mapping[str, Any], tools: Optional[List[Any]] = None,
               record: Optional[Mapping[str, Any]] = None) -> Document:
    assert render is not None, "a chat format without a template is refused before the workers start"
    weights = [m.pop("weight", 1) for m in messages if m["role"] == "assistant"]  # not the template's to read
    _refuse_unasked(messages, weights, spec, record or {})
    text, spans = conversation_spans(messages, render, variables, tools)
    if spec.train_on == TrainOn.all:
        return Document(text, [(0, len(text))], False, False)
    if 0 in weights:
        if len(spans) != len(weights):
            raise BadRecord(f"an assistant message has weight 0, but the chat template's {{% generation %}} blocks "
                            f"({len(spans)}) do not pair with the assistant messages ({len(weights)}): which to leave "
                            "untrained cannot be told; remove the weights or use a template without such blocks")
        spans = [span for span, weight in zip(spans, weights) if weight]
        if not spans:
            raise BadRecord("every assistant message has weight 0: nothing to train")
    return Document(text, _pick(spans, spec.train_on), False, False)


def _as_dict(record: Any) -> Dict[str, Any]:
    if not isinstance(record, dict):
        raise BadRecord(f"a record is a JSON object; this is a {type(record).__name__}")
    return record
