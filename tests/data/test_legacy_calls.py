"""OpenAI's legacy function calling (``function_call``, ``role: function``, ``functions``), on stock templates.

A legacy record must train exactly what the same conversation in today's shape
(``tool_calls``, ``tool``, ``tools``) trains, on the verbatim templates of Qwen2.5,
Llama 3.1 and Mistral v0.3 (which renders the call ids), or be refused naming the
legacy format: never a call or a result dropped (issue 49, item 2).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from fsdp_workflow.config.schema import OnBadRecord
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.prepare import main as prepare_main
from fsdp_workflow.data.templates import CHATML

from .conftest import chat_run_dir
from .test_families import FAMILIES, encode, make_tokenizer
from .test_tools_and_parts import ANSWER, RESULT, TOOLS, tool_conversation

NAMES = ["qwen2.5", "llama3.1", "mistral-v0.3"]
ARGS = json.dumps({"city": "Paris"})  # legacy arguments are a JSON string
FUNCTIONS = [t["function"] for t in TOOLS]


def legacy(content: Any = None, result_role: str = "function") -> List[Dict[str, Any]]:
    """user -> assistant function_call -> the result (``role: function``, or a ``tool`` turn) -> answer."""
    result: Dict[str, Any] = {"role": result_role, "name": "get_weather", "content": RESULT}
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "function_call": {"name": "get_weather", "arguments": ARGS}},
            result, {"role": "assistant", "content": ANSWER}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return {n: make_tokenizer(FAMILIES[n], tmp_path_factory.mktemp(n)) for n in NAMES}


CASES = [  # (the legacy conversation, the content the modern one has beside its call)
    ("beside-text-tool-result", legacy("Let me check.", "tool"), "Let me check."),  # the call was dropped
    ("null-content-function-result", legacy(None, "function"), None),  # refused, the legacy format unnamed
    ("no-content-function-result", [{k: v for k, v in m.items() if k != "content" or m["role"] != "assistant"
                                     or "function_call" not in m} for m in legacy()], None),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_legacy_call_trains_what_the_same_tool_call_trains(toks: Dict[str, Any], name: str, case: tuple) -> None:
    """Tokens and trained labels equal the modern record's (call00001: the id Mistral renders)."""
    tok, (_, conv, content) = toks[name], case
    for rec in ({"messages": copy.deepcopy(conv), "tools": TOOLS},
                {"messages": copy.deepcopy(conv), "functions": FUNCTIONS}):
        got = encode(tok, tok.chat_template, [rec])
        assert not got.bad, got.bad
        ref = encode(tok, tok.chat_template, [{"messages": tool_conversation(ARGS, content), "tools": TOOLS}])
        assert not ref.bad, ref.bad
        assert got.tokens.tolist() == ref.tokens.tolist()
        assert got.labels.tolist() == ref.labels.tolist()
        trained = tok.decode(got.tokens[got.labels != IGNORE_INDEX])
        assert '"get_weather"' in trained and '"Paris"' in trained and ANSWER in trained
        assert RESULT not in trained and RESULT in tok.decode(got.tokens)


def test_an_api_dump_with_null_legacy_keys_is_a_plain_conversation(toks: Dict[str, Any]) -> None:
    """Chat Completions responses write ``function_call: null`` (and ``tool_calls: null``) on every message."""
    tok = toks["qwen2.5"]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    dumped = [plain[0], {**plain[1], "function_call": None, "tool_calls": None}]
    a, b = encode(tok, tok.chat_template, [{"messages": dumped}]), encode(tok, tok.chat_template, [{"messages": plain}])
    assert not a.bad and a.tokens.tolist() == b.tokens.tolist() and a.labels.tolist() == b.labels.tolist()


def test_a_template_without_tools_refuses_a_legacy_call(toks: Dict[str, Any]) -> None:
    """chatml never reads tool_calls: the record is bad, naming data.chat_template and the call (it was trained
    as "Let me check." followed by a tool result that nothing called)."""
    res = encode(toks["qwen2.5"], CHATML, [{"messages": legacy("Let me check.", "tool")}])
    assert len(res.bad) == 1 and res.labels.size == 0
    assert "data.chat_template" in res.bad[0][2] and "get_weather" in res.bad[0][2]


def _with(n: int, **changes: Any) -> List[Dict[str, Any]]:
    conv = legacy()
    conv[n] = {**conv[n], **changes}
    return conv


BAD = [
    ("arguments-not-json", _with(1, function_call={"name": "get_weather", "arguments": "{city: Paris"}),
     "messages[1] (assistant)", "legacy function-calling format) to 'get_weather' has arguments that are not JSON"),
    ("call-a-string", _with(1, function_call="get_weather"), "messages[1] (assistant)", "legacy"),
    ("call-on-a-user", [{"role": "user", "content": "x", "function_call": {"name": "f"}}, *legacy()[2:]],
     "messages[0] (user)", "legacy"),
    ("both-shapes", _with(1, tool_calls=tool_conversation(ARGS)[1]["tool_calls"]), "messages[1] (assistant)",
     "legacy"),
    ("result-without-name", _with(2, name=None), "messages[2] (function)", "legacy"),
    ("result-nothing-called", [legacy()[0], legacy()[2], legacy()[3]], "messages[1] (function)", "legacy"),
]


@pytest.mark.parametrize("conv,where,why", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_legacy_shape_that_cannot_be_read_is_refused_naming_it(toks: Dict[str, Any], conv: list, where: str,
                                                                 why: str) -> None:
    tok = toks["qwen2.5"]
    res = encode(tok, tok.chat_template, [{"messages": conv, "tools": TOOLS}])
    assert len(res.bad) == 1 and res.labels.size == 0, res.bad
    assert res.bad[0][2].startswith(where) and why in res.bad[0][2], res.bad[0][2]


def test_functions_and_tools_together_are_refused(toks: Dict[str, Any]) -> None:
    tok = toks["qwen2.5"]
    res = encode(tok, tok.chat_template, [{"messages": legacy(), "tools": TOOLS, "functions": FUNCTIONS}])
    assert res.bad and "both tools and functions" in res.bad[0][2] and "legacy" in res.bad[0][2]


def test_prepare_names_the_legacy_record_by_file_and_line_and_skip_leaves_it_out(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Through the data step's command: fail exits 2 naming chat.jsonl:2; skip counts it, trains the rest."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    cfg = chat_run_dir(tmp_path, [good, {"messages": legacy("Let me check.", "tool")}])
    assert prepare_main([cfg.run_dir]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:2" in err and "get_weather" in err and "data.chat_template" in err
    assert "data.fields" not in err
    from fsdp_workflow.config.load import to_yaml
    from fsdp_workflow.config.schema import run_layout
    cfg.data.on_bad_record = OnBadRecord.skip
    run_layout(cfg).config.write_text(to_yaml(cfg))
    assert prepare_main([cfg.run_dir]) == 0
    meta = json.loads(Path(json.loads((Path(cfg.run_dir) / "data.json").read_text())["cache"], "meta.json")
                      .read_text())
    assert meta["bad_records"] == 1 and meta["splits"]["train"]["documents"] == 1
