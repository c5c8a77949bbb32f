"""Preference data given to SFT, and answers that no question precedes (issue 49, item 3).

Preference data (``prompt``/``chosen``/``rejected``) is named as such with the route that
trains it, and that route is checked to train the chosen answer with its prompt. A trained
answer with no user turn before it is a bad record (file and line, ``on_bad_record``)
unless ``data.allow_no_user=true``. The commands are the real ones: ``python -m
fsdp_workflow`` (forked) with the shipped ``smoke_chat`` experiment and its byte-level
tokenizer, then the data step's own ``main``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import forked_cli  # tests/forked_cli.py
import numpy as np
import pytest

from fsdp_workflow.config.schema import DataFormat, TrainOn
from fsdp_workflow.data.cache import IGNORE_INDEX, LABELS, TOKENS
from fsdp_workflow.data.formats import BadRecord, FormatSpec, to_document
from fsdp_workflow.data.prepare import main as prepare_main
from fsdp_workflow.data.templates import CHATML, ChatTemplate

from .conftest import write_jsonl

PAIRS = [("What is 2 + 2?", "2 + 2 = 4.", "2 + 2 = 5."), ("Capital of France?", "Paris.", "Lyon.")]
STRING_PREFS = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
# TRL's conversational form with an explicit prompt: the prompt holds the user turn, chosen the answer alone.
CONV_PREFS = [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
               "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS]
ROUTE = "data.format=prompt_completion +data.fields.completion=chosen"


def plan(tmp_path: Path, name: str, records: List[Any], *overrides: str) -> Path:
    """``python -m fsdp_workflow +experiment=smoke_chat ... dry_run=true``: the run directory it wrote."""
    data = write_jsonl(tmp_path / f"{name}.jsonl", records)
    run_dir = tmp_path / name
    res = forked_cli.run(["+experiment=smoke_chat", f"data.path={data}", f"run_dir={run_dir}", "dry_run=true",
                          "data.chat_template=chatml", *overrides])
    assert res.returncode == 0, res.stdout + res.stderr
    return run_dir


def cache_text(run_dir: Path) -> Tuple[str, str]:
    """(every document's text, the trained text) of the train split, decoded from the byte-level ids."""
    cache = Path(json.loads((run_dir / "data.json").read_text())["cache"])
    tokens, labels = np.load(cache / "train" / TOKENS), np.load(cache / "train" / LABELS)
    as_text = lambda ids: bytes(int(i) for i in ids if i < 256).decode()  # noqa: E731 - ids 0-255 are bytes
    return as_text(tokens), as_text(tokens[labels != IGNORE_INDEX])


def test_preference_data_given_to_sft_is_named_with_its_routes(tmp_path: Path) -> None:
    """The whole command, as a user runs it: exit 2 before training, each record named as preference data
    with the override that trains it (not the field mapping that trained answers without their prompt)."""
    data = write_jsonl(tmp_path / "pref.jsonl", STRING_PREFS)
    run_dir = tmp_path / "run"
    res = forked_cli.run(["+experiment=smoke_chat", f"data.path={data}", f"run_dir={run_dir}"], timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert f"{data}:1: preference data" in out and f"{data}:2: preference data" in out
    assert "preference training (DPO) is not built yet" in out and ROUTE in out
    assert "data.fields.messages" not in out and "map the field names" not in out
    assert "nothing was trained" in out and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("records", [STRING_PREFS, CONV_PREFS], ids=["strings", "trl-conversational"])
def test_the_suggested_route_trains_the_chosen_answer_with_its_prompt(tmp_path: Path, records: List[Any],
                                                                      capsys: pytest.CaptureFixture) -> None:
    """The override the refusal suggests, taken from its own words, trains each chosen answer (and only it)
    after its prompt; the rejected answers are nowhere."""
    refused = plan(tmp_path, "refused", records)
    assert prepare_main([str(refused)]) == 2
    suggested = re.search(r"with its prompt: (.*)$", capsys.readouterr().err, re.M)
    assert suggested, "the refusal gives no route"
    run_dir = plan(tmp_path, "route", records, *suggested.group(1).split())
    assert prepare_main([str(run_dir)]) == 0
    text, trained = cache_text(run_dir)
    for prompt, chosen, rejected in PAIRS:
        assert prompt in text and prompt not in trained  # the question is there, not trained
        assert chosen in trained and rejected not in text
        assert text.index(prompt) < text.index(chosen)


def test_the_old_hint_now_refuses_answers_without_their_question(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """``+data.fields.messages=chosen`` on TRL's explicit-prompt data trained every answer with no user turn
    (exit 0); now each record is a bad record, by file and line, with the route."""
    run_dir = plan(tmp_path, "pref", CONV_PREFS, "+data.fields.messages=chosen")
    assert prepare_main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    for line, (_, chosen, _) in enumerate(PAIRS, start=1):
        assert f"pref.jsonl:{line}: no user turn before the assistant turn {chosen!r}" in err
    assert "preference data" in err and ROUTE in err
    assert not (run_dir / "data.json").exists()


SYSTEM_ONLY = {"messages": [{"role": "system", "content": "Write a haiku about rain."},
                            {"role": "assistant", "content": "Soft rain on the roof."}]}
ASKED = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there."}]}


def test_a_conversation_without_a_user_turn_is_refused_or_skipped_unless_the_data_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """fail: exit 2 naming chat.jsonl:2 and data.allow_no_user; skip: counted and left out;
    data.allow_no_user=true (a key the command accepts): trained."""
    records = [ASKED, SYSTEM_ONLY]
    failed = plan(tmp_path, "fail", records)
    assert prepare_main([str(failed)]) == 2
    err = capsys.readouterr().err
    assert "fail.jsonl:2: no user turn before the assistant turn 'Soft rain on the roof.'" in err
    assert "data.allow_no_user=true" in err and "fail.jsonl:1" not in err

    skipped = plan(tmp_path, "skip", records, "data.on_bad_record=skip")
    assert prepare_main([str(skipped)]) == 0
    text, trained = cache_text(skipped)
    assert "Hi there." in trained and "Soft rain" not in text

    allowed = plan(tmp_path, "allow", records, "data.allow_no_user=true")
    assert prepare_main([str(allowed)]) == 0
    text, trained = cache_text(allowed)
    assert "Soft rain on the roof." in trained and "Write a haiku" in text and "Write a haiku" not in trained
    assert json.loads((allowed / "data.json").read_text())["cache"] != \
        json.loads((skipped / "data.json").read_text())["cache"]  # the key is part of the cache's identity


# ---- which answers count as trained, in the format code itself ----

def _doc(record: Dict[str, Any], fmt: DataFormat = DataFormat.conversation, train_on: TrainOn = TrainOn.assistant,
         template: Any = CHATML, allow: bool = False) -> Any:
    spec = FormatSpec(fmt, "text", {}, train_on, True, template, allow)
    return to_document(record, spec, ChatTemplate(template) if template else None, {})


GREETING = {"role": "assistant", "content": "Hello, how can I help?"}


@pytest.mark.parametrize("messages,train_on,refused", [
    ([GREETING, *ASKED["messages"]], TrainOn.assistant, True),  # the greeting is trained, asked by nobody
    ([{**GREETING, "weight": 0}, *ASKED["messages"]], TrainOn.assistant, False),  # ... unless weight 0
    ([GREETING, *ASKED["messages"]], TrainOn.last_assistant, False),  # only the asked answer is trained
    ([GREETING, *ASKED["messages"]], TrainOn.all, True),
    ([{"role": "user", "content": "  "}, GREETING], TrainOn.assistant, True),  # an empty question asks nothing
], ids=["greeting", "greeting-weight-0", "greeting-last-assistant", "greeting-all", "empty-user"])
def test_the_first_trained_answer_needs_a_question(messages: List[Dict[str, Any]], train_on: TrainOn,
                                                   refused: bool) -> None:
    if refused:
        with pytest.raises(BadRecord, match="no user turn before the assistant turn 'Hello, how can I help"):
            _doc({"messages": messages}, train_on=train_on)
    assert _doc({"messages": messages}, train_on=train_on, allow=True).spans
    if not refused:
        assert _doc({"messages": messages}, train_on=train_on).spans


@pytest.mark.parametrize("template", [None, CHATML], ids=["plain", "chatml"])
def test_an_empty_prompt_is_no_question(template: Any) -> None:
    rec = {"prompt": "", "completion": "Once upon a time."}
    with pytest.raises(BadRecord, match="no question.*data.allow_no_user=true"):
        _doc(rec, DataFormat.prompt_completion, template=template)
    doc = _doc(rec, DataFormat.prompt_completion, template=template, allow=True)
    assert "Once upon a time." in "".join(doc.text[a:b] for a, b in doc.spans)


def test_implicit_prompt_preference_data_is_routed_to_its_conversations() -> None:
    """Without ``prompt``, chosen is a whole conversation: the route maps it, and that trains it asked."""
    rec = {"chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
           "rejected": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Go away."}]}
    with pytest.raises(BadRecord, match=r"preference data .*not built yet.*: \+data\.fields\.messages=chosen$"):
        _doc(rec)
    mapped = FormatSpec(DataFormat.conversation, "text", {"messages": "chosen"}, TrainOn.assistant, True, CHATML)
    out = to_document(rec, mapped, ChatTemplate(CHATML), {})
    assert "Hi?" in out.text and "Hello." in "".join(out.text[a:b] for a, b in out.spans)


def test_preference_data_read_as_prompt_completion_is_named_too() -> None:
    with pytest.raises(BadRecord, match=r"^preference data .*: \+data\.fields\.completion=chosen$"):
        _doc(STRING_PREFS[0], DataFormat.prompt_completion)
