"""Finding what an assistant said in one rendering of a conversation.

The stock chat templates of real models carry no ``{% generation %}`` markers,
and several render a conversation's prefix differently from the whole (Qwen3
adds an empty think block before the last answer only, Phi-3 ends with
``<|endoftext|>`` unless a reply is asked for, Mistral-Nemo moves the system
prompt into the last user turn). So the conversation is rendered once, and the
messages are found in that text, in order:

- the message right before each assistant message (its prompt) moves a
  cursor past it, when the template writes it verbatim (other messages may
  move: Mistral-Nemo writes the system prompt into the last user turn);
- each assistant message's content is found after the cursor, followed by the
  template's end-of-turn marker (:meth:`ChatTemplate.end_of_turn`), and
  preceded by the template's assistant header where it is. Its span is that
  content plus the marker. Content the template trims (Llama's ``| trim``) is
  found trimmed.
- reasoning (``reasoning_content``, or ``<think>...</think>`` at the start of the
  content) is trained where the template writes it, from its ``<think>`` tag on;
  a template that drops it (DeepSeek-R1's, Qwen3's before the last question)
  trains the answer alone.

Everything else in the rendering is the template's own text and is never
trained: role headers, default system prompts, dates, empty think blocks, the
newline between turns.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class SpanNotFound(ValueError):
    """An assistant message is not in the rendering as the template should write it; the message says which."""


def split_reasoning(message: Dict[str, Any]) -> Tuple[Optional[str], str]:
    """``(reasoning, answer)`` of an assistant message: ``reasoning_content``, or a leading think block."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        return reasoning, content
    if THINK_CLOSE in content:
        head, _, answer = content.rpartition(THINK_CLOSE)
        return head.split(THINK_OPEN)[-1], answer
    return None, content


def _variants(text: str) -> Iterator[str]:
    """The forms a template may write ``text`` in: as is, without surrounding newlines, trimmed.

    One at a time, each cut once from ``text``: a 50 MB answer costs one copy at a time, not four.
    """
    n = len(text)
    seen = set()
    for lead, trail in (("", ""), ("\n", "\n"), ("\n", ""), (None, None)):  # None: any whitespace (str.strip)
        a = 0
        while a < n and (text[a].isspace() if lead is None else text[a] in lead):
            a += 1
        b = n
        while b > a and (text[b - 1].isspace() if trail is None else text[b - 1] in trail):
            b -= 1
        if b > a and (a, b) not in seen:
            seen.add((a, b))
            yield text if (a, b) == (0, n) else text[a:b]


def _find_answer(full: str, answer: str, eot: str, cursor: int, header: str) -> Tuple[int, int]:
    """``(start, end of the end-of-turn marker)`` of the first form of ``answer`` followed by ``eot``.

    Preceded by ``header`` (what the template writes before an answer) where it is,
    so that an answer that also occurs in the template's own text is not taken there.
    """
    for lead in ((header, "") if header else ("",)):
        for v in _variants(answer):
            i = full.find(lead + v + eot, cursor)
            if i >= 0:
                return i + len(lead), i + len(lead) + len(v) + len(eot)
    for v in _variants(answer):  # whitespace between the answer and the marker (rare)
        i = full.find(v, cursor)
        while i >= 0:
            j = i + len(v)
            k = j + (len(full[j:j + 64]) - len(full[j:j + 64].lstrip()))
            if full.startswith(eot, k):
                return i, k + len(eot)
            i = full.find(v, i + 1)
    return -1, -1


def assistant_spans(full: str, messages: Sequence[Dict[str, Any]], eot: str, header: str = "",
                    known: Optional[Dict[int, Tuple[int, int]]] = None) -> List[Tuple[int, int]]:
    """One ``[start, end)`` character span per assistant message of ``messages``, in order.

    Args:
        full: the one rendering of ``messages``.
        messages: the conversation (``role``, ``content``, optional ``reasoning_content``).
        eot: the template's end-of-turn marker.
        header: what the template writes between a user message and the answer (tried first; may be empty).
        known: spans already found by message index (tool calls, :mod:`fsdp_workflow.data.tools`).

    Returns:
        The spans: each answer (and the reasoning the template wrote for it) plus ``eot``.

    Raises:
        SpanNotFound: an assistant answer followed by ``eot`` is not in the rendering after the previous turn.
    """
    spans: List[Tuple[int, int]] = []
    cursor = 0
    for n, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if known and n in known:
            spans.append(known[n])
            cursor = known[n][1]
            continue
        prompt = messages[n - 1] if n > 0 and messages[n - 1]["role"] != "assistant" else None
        if prompt is not None:  # only the prompt right before: a template may move others (Nemo's system)
            for v in _variants(prompt.get("content") or ""):
                i = full.find(v, cursor)
                if i >= 0:
                    cursor = i + len(v)
                    break
        reasoning, answer = split_reasoning(m)
        content = m.get("content") or ""
        start, end = -1, -1
        if reasoning is not None and THINK_CLOSE in content:  # a think block in the content, written verbatim?
            start, end = _find_answer(full, content, eot, cursor, header)
        if start < 0:  # no think block, reasoning_content, or the template rewrote it
            start, end = _find_answer(full, answer, eot, cursor, header)
            if start < 0:
                raise SpanNotFound(
                    f"assistant message {n} followed by the template's end-of-turn marker {eot!r} is not in the "
                    "rendered conversation (the chat template changes what the assistant said). Mark the assistant "
                    "turns with {% generation %} ... {% endgeneration %} in data.chat_template to say what to train.")
            if reasoning is not None and reasoning.strip():
                r = full.rfind(reasoning.strip(), cursor, start)
                if r >= 0:
                    tag = full.rfind(THINK_OPEN, cursor, r)
                    start = tag if tag >= 0 else r
        spans.append((start, end))
        cursor = end
    return spans
