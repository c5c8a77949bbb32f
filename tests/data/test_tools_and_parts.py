"""Tool calling and content parts, on the verbatim stock templates (tests/data/templates).

The oracle is transformers' own rendering (``apply_chat_template(..., tools=...)``)
and a hand rule per family for what an assistant turn is (its header, the call,
the end-of-turn string), independent of fsdp_workflow.data.tools.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from fsdp_workflow.config.schema import DataFormat, DataSource, TrainOn
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.prepare import main as prepare_main
from fsdp_workflow.data.templates import CHATML

from .conftest import chat_run_dir
from .test_families import FAMILIES, encode, make_tokenizer, overlap_mask

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
RESULT = "temp=22;sky=clear"
ANSWER = "It is 22 C and clear in Paris."


def tool_conversation(arguments: Any, content: Any = None) -> List[Dict[str, Any]]:
    """user -> assistant calls get_weather -> tool result -> assistant answers (OpenAI export shape)."""
    call = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": RESULT},
            {"role": "assistant", "content": ANSWER}]


# Per family: what opens an assistant turn (any of), and the end-of-turn string that closes it.
OPENS = {"llama3.1": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
         "llama3.2": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
         "llama3.3": ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
         "qwen2.5": ("<|im_start|>assistant\n",), "qwen3": ("<|im_start|>assistant\n",),
         "mistral-v0.3": ("[/INST] ", "[/INST]", "[/TOOL_RESULTS] ", "[/TOOL_RESULTS]"), "mistral-nemo": ("[/INST]", "[/TOOL_RESULTS]")}


def oracle(name: str, text: str) -> List[Tuple[int, int]]:
    """Each assistant turn: after its opener (the longest that matches), skipping Qwen3's own empty think block.

    Mistral has no assistant header: a turn is what follows ``[/INST]`` or the last of a run of
    ``[TOOL_RESULTS]`` blocks (one result followed by another opens nothing)."""
    fam, spans, i = FAMILIES[name], [], 0
    while True:
        hits = [(text.find(o, i), -len(o), o) for o in OPENS[name] if text.find(o, i) >= 0]
        if not hits:
            return spans
        h, _, o = min(hits)
        start = h + len(o)
        if text.startswith("[TOOL_RESULTS]", start):  # the next result of the same calls, not a turn
            i = start
            continue
        if fam.empty_think and text.startswith(fam.empty_think, start):
            start += len(fam.empty_think)
        end = text.find(fam.eot, start)
        if end < 0:
            return spans
        spans.append((start, end + len(fam.eot)))
        i = end


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return {n: make_tokenizer(FAMILIES[n], tmp_path_factory.mktemp(n)) for n in list(OPENS) + ["gemma3"]}


@pytest.mark.parametrize("arguments", ["object", "string"])
@pytest.mark.parametrize("name", list(OPENS))
def test_tool_call_is_trained_as_the_assistants_output(toks: Dict[str, Any], name: str, arguments: str) -> None:
    """The call (in the family's own syntax) and its end-of-turn are trained; tools and results never."""
    tok = toks[name]
    args = {"city": "Paris"} if arguments == "object" else json.dumps({"city": "Paris"})
    conv = tool_conversation(args, content=None)
    res = encode(tok, tok.chat_template, [{"messages": conv, "tools": TOOLS}])
    assert not res.bad, res.bad
    normalised = tool_conversation({"city": "Paris"}, content="")  # what transformers is given: object args, ""
    text = tok.apply_chat_template(normalised, tools=TOOLS, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert res.tokens.tolist() == enc["input_ids"]  # the same rendering as transformers, tools included
    spans = oracle(name, text)
    assert len(spans) == 2
    assert (res.labels != IGNORE_INDEX).astype(int).tolist() == overlap_mask(enc["offset_mapping"], spans)
    trained = tok.decode(res.tokens[res.labels != IGNORE_INDEX])
    assert '"get_weather"' in trained and '"Paris"' in trained and ANSWER in trained
    assert trained.count(FAMILIES[name].eot) == 2  # the call turn teaches the model to stop too
    for untrained in (RESULT, "Weather in a city", "Weather in Paris?"):
        assert untrained not in trained
    if name.startswith("qwen"):
        assert "<tool_call>" in trained
    if name.startswith("mistral"):
        assert "[TOOL_CALLS]" in trained


def _call(i: int, city: str) -> Dict[str, Any]:
    return {"id": f"call0000{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def _result(i: int, city: str) -> Dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call0000{i}", "name": "get_weather", "content": f"{city}: {RESULT}"}


CHAINED = [{"role": "user", "content": "Weather in Paris, then in Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris")]}, _result(1, "Paris"),
           {"role": "assistant", "content": "", "tool_calls": [_call(2, "Oslo")]}, _result(2, "Oslo"),
           {"role": "assistant", "content": ANSWER}]
PARALLEL = [{"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris"), _call(2, "Oslo")]},
            _result(1, "Paris"), _result(2, "Oslo"), {"role": "assistant", "content": ANSWER}]


def _renders(tok: Any, conv: List[Dict[str, Any]]) -> bool:
    try:
        tok.apply_chat_template(conv, tools=TOOLS, tokenize=False)
        return True
    except Exception:  # noqa: BLE001 - a template's raise_exception: the family cannot hold this shape
        return False


@pytest.mark.parametrize("shape", ["chained", "parallel"])
@pytest.mark.parametrize("name", list(OPENS))
def test_several_calls_are_each_trained_and_every_result_is_not(toks: Dict[str, Any], name: str, shape: str) -> None:
    """Calls one after another (call, result, call, result, answer) or at once (two calls, two results):
    each assistant turn is trained as the family's template writes it, no tool result ever. A family
    whose template refuses the shape (Llama 3.x: one call per turn) gets the record refused, with the
    template's own words, not a silently partial render."""
    tok, conv = toks[name], CHAINED if shape == "chained" else PARALLEL
    res = encode(tok, tok.chat_template, [{"messages": copy.deepcopy(conv), "tools": TOOLS}])
    if not _renders(tok, conv):
        assert name.startswith("llama") and shape == "parallel", name
        assert len(res.bad) == 1 and res.labels.size == 0 and "single tool-call" in res.bad[0][2], res.bad
        return
    assert not res.bad, res.bad
    text = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert res.tokens.tolist() == enc["input_ids"]
    spans = oracle(name, text)
    assert len(spans) == (3 if shape == "chained" else 2), spans
    assert (res.labels != IGNORE_INDEX).astype(int).tolist() == overlap_mask(enc["offset_mapping"], spans)
    trained = tok.decode(res.tokens[res.labels != IGNORE_INDEX])
    assert '"Paris"' in trained and '"Oslo"' in trained and ANSWER in trained
    assert RESULT not in trained and "Weather in a city" not in trained


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3.1"])
def test_content_beside_a_call_is_trained_with_it(toks: Dict[str, Any], name: str) -> None:
    """Non-empty content next to tool_calls: both are trained (the call used to be dropped)."""
    tok = toks[name]
    res = encode(tok, tok.chat_template, [{"messages": tool_conversation({"city": "Paris"}, "Let me check."),
                                           "tools": TOOLS}])
    assert not res.bad, res.bad
    rendered = tok.decode(res.tokens)
    trained = tok.decode(res.tokens[res.labels != IGNORE_INDEX])
    if "Let me check." in rendered:  # Llama 3.1's template writes the call alone
        assert "Let me check." in trained
    assert "get_weather" in trained


def test_qwen3_null_content_beside_a_call_fails_in_transformers_and_is_normalised(toks: Dict[str, Any]) -> None:
    tok = toks["qwen3"]
    conv = tool_conversation({"city": "Paris"}, content=None)
    with pytest.raises(Exception):
        tok.apply_chat_template(conv, tools=TOOLS, tokenize=False)
    res = encode(tok, tok.chat_template, [{"messages": conv, "tools": TOOLS}])
    assert not res.bad and res.labels.size


def test_last_assistant_trains_only_the_answer(toks: Dict[str, Any]) -> None:
    tok = toks["qwen2.5"]
    res = encode(tok, tok.chat_template, [{"messages": tool_conversation({"city": "Paris"}), "tools": TOOLS}],
                 TrainOn.last_assistant)
    trained = tok.decode(res.tokens[res.labels != IGNORE_INDEX])
    assert ANSWER in trained and "get_weather" not in trained


@pytest.mark.parametrize("template", ["chatml", "gemma3", "comment-only"])
def test_a_template_that_cannot_render_calls_refuses_the_record(toks: Dict[str, Any], template: str) -> None:
    """Never a silently dropped call: the record is bad, naming data.chat_template."""
    tok = toks["qwen2.5"]
    text = {"chatml": CHATML, "gemma3": toks["gemma3"].chat_template,
            # reads tool_calls (so passes the first check) but writes nothing of them
            "comment-only": CHATML.replace("{% for", "{% set x = messages[0].tool_calls %}{% for", 1)}[template]
    res = encode(tok, text, [{"messages": tool_conversation({"city": "Paris"}, "Checking.")}])
    assert len(res.bad) == 1 and res.labels.size == 0
    assert "data.chat_template" in res.bad[0][2] and "get_weather" in res.bad[0][2]


def test_a_template_that_drops_the_tool_list_refuses_the_record(toks: Dict[str, Any]) -> None:
    tok = toks["qwen2.5"]
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    res = encode(tok, CHATML, [{"messages": conv, "tools": TOOLS}])
    assert res.bad and "tools" in res.bad[0][2] and "data.chat_template" in res.bad[0][2]


@pytest.mark.parametrize("bad,why", [
    ("{city: Paris", "arguments are a string that is not JSON"),
    ('["Paris"]', "arguments are a list, not an object"),
])
def test_bad_call_arguments_are_named(toks: Dict[str, Any], bad: str, why: str) -> None:
    tok = toks["qwen3"]
    res = encode(tok, tok.chat_template, [{"messages": tool_conversation(bad), "tools": TOOLS}])
    assert res.bad and res.bad[0][2].startswith("messages[1] (assistant)") and why in res.bad[0][2]


def test_sharegpt_function_call_and_observation(toks: Dict[str, Any]) -> None:
    """LLaMA-Factory's ShareGPT: from function_call/observation, tools as a JSON string."""
    tok = toks["qwen2.5"]
    rec = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                             {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                            "arguments": {"city": "Paris"}})},
                             {"from": "observation", "value": RESULT},
                             {"from": "gpt", "value": ANSWER}], "tools": json.dumps(TOOLS)}
    res = encode(tok, tok.chat_template, [rec])
    assert not res.bad, res.bad
    ref = encode(tok, tok.chat_template, [{"messages": tool_conversation({"city": "Paris"}), "tools": TOOLS}])
    assert res.tokens.tolist() == ref.tokens.tolist() and res.labels.tolist() == ref.labels.tolist()


# ---- content as a list of parts ----

def test_text_parts_are_joined(toks: Dict[str, Any]) -> None:
    tok = toks["qwen2.5"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}]
    plain = [{"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Hi."}]
    a, b = encode(tok, tok.chat_template, [{"messages": parts}]), encode(tok, tok.chat_template, [{"messages": plain}])
    assert not a.bad and a.tokens.tolist() == b.tokens.tolist() and a.labels.tolist() == b.labels.tolist()


def test_an_image_part_is_refused_with_the_record_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    cfg = chat_run_dir(tmp_path, [good, image])
    assert prepare_main([cfg.run_dir]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:2" in err and "'image_url'" in err and "only text parts" in err
    assert "data.fields" not in err  # a field mapping is not the fix
    assert not (Path(cfg.run_dir) / "data.json").exists()  # nothing half-written


def test_a_tool_record_with_chatml_fails_prepare_naming_file_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    cfg = chat_run_dir(tmp_path, [{"messages": tool_conversation({"city": "Paris"}, "Checking."), "tools": TOOLS}])
    assert prepare_main([cfg.run_dir]) == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:1" in err and "data.chat_template" in err and "data.fields" not in err
