"""Preference data given to SFT: named as what it is, with the routes that train it.

A preference record holds two answers to one prompt (TRL's ``DPOTrainer`` format):
``{"prompt": ..., "chosen": ..., "rejected": ...}``, each a string or, in TRL's
conversational form, a list of messages (``prompt`` the user turns, ``chosen`` and
``rejected`` the assistant's); without ``prompt`` the two are whole conversations
(the "implicit prompt" form). Mapping ``chosen`` as the conversation of an explicit-prompt
record would train every answer without its question, so no field mapping is
offered: the message says that preference training is not built, and gives the
override that fine-tunes on the chosen answer with its prompt, as the record's
shape needs it.
"""

from __future__ import annotations

from typing import Any, Mapping

from fsdp_workflow.config.schema import DataFormat

CHOSEN, REJECTED = "chosen", "rejected"
PROMPT = "prompt"


def is_preference(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` holds a chosen and a rejected answer."""
    return CHOSEN in record and REJECTED in record


def _asks(messages: Any) -> bool:
    """Whether a list of messages holds a user turn (OpenAI's or ShareGPT's spelling)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "user" or m.get("from") == "human") for m in messages)


def _set(fields: Mapping[str, str], canonical: str, value: str) -> str:
    """The override that maps ``canonical`` to ``value`` (``+`` adds a key that ``data.fields`` lacks)."""
    return f"{'' if canonical in fields else '+'}data.fields.{canonical}={value}"


def preference_advice(record: Mapping[str, Any], fmt: DataFormat, fields: Mapping[str, str]) -> str:
    """Why a preference record is not SFT data as it is, and the override that trains its chosen answer.

    Args:
        record: a record for which :func:`is_preference` holds.
        fmt: the ``data.format`` it was read with.
        fields: the field mapping it was read with (``data.fields``).

    Returns:
        A message starting ``preference data``, naming its fields and the route.
    """
    mapped = fields.get(PROMPT, PROMPT)
    key = mapped if mapped in record else PROMPT if PROMPT in record else None
    names = ", ".join(repr(k) for k in (key, CHOSEN, REJECTED) if k)
    head = (f"preference data (fields {names}: two answers to one prompt, as TRL's DPOTrainer reads it); "
            "SFT trains one answer, and preference training (DPO) is not built yet. ")
    if key is not None:
        override = ("" if fmt == DataFormat.prompt_completion else "data.format=prompt_completion ")
        override += _set(fields, "completion", CHOSEN)
        if key != mapped:
            override += " " + _set(fields, PROMPT, key)
        return head + f"To fine-tune on the chosen answer with its prompt: {override}"
    if _asks(record[CHOSEN]):
        override = ("" if fmt == DataFormat.conversation else "data.format=conversation ")
        return head + ("The chosen conversations hold their prompt; to fine-tune on them: "
                       f"{override}{_set(fields, 'messages', CHOSEN)}")
    return head + ("No field holds the prompt; name it to fine-tune on the chosen answer with it: "
                   f"data.format=prompt_completion {_set(fields, PROMPT, 'NAME')} {_set(fields, 'completion', CHOSEN)}")
