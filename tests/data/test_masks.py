"""Loss masks: the peer check against transformers, each format, each train_on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

from fsdp_workflow.config.schema import DataFormat, DataSource, ModelConfig, ModelInit, Overlong, TrainOn
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.encode import EncodeSpec, encode_chunk, init_worker
from fsdp_workflow.data.formats import ALPACA_PROMPT_NO_INPUT, FormatSpec
from fsdp_workflow.data.prepare import prepare
from fsdp_workflow.data.templates import SHIPPED_TEMPLATES
from fsdp_workflow.data.tokenizer import byte_level_tokenizer, load_tokenizer

from .conftest import make_cfg, write_jsonl

CONVERSATIONS: List[List[Dict[str, str]]] = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Name a container type."}, {"role": "assistant", "content": "A deque."},
     {"role": "user", "content": "And another?"}, {"role": "assistant", "content": "An OrderedDict, with order."}],
    [{"role": "user", "content": "Ünïcödé — naïve café? 日本語"}, {"role": "assistant", "content": "Oui: 東京 ✓ ünïcode"}],
]


def _encode(tokenizer: Any, records: List[Any], fmt: DataFormat, template: Optional[str],
            train_on: TrainOn = TrainOn.assistant, seq_len: int = 4096,
            fields: Optional[Dict[str, str]] = None) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(token ids, trained flags) per record, through the workers' code path."""
    spec = EncodeSpec(ModelConfig(name="t", init=ModelInit.random), FormatSpec(fmt, "text", fields or {}, train_on,
                      True, template), False, seq_len, Overlong.truncate)
    init_worker(spec, tokenizer)
    res = encode_chunk(("mem", list(enumerate(records, 1))))
    assert not res.bad, res.bad
    bounds = np.concatenate([[0], np.cumsum(res.lengths)])
    return [(res.tokens[a:b], res.labels[a:b] != IGNORE_INDEX) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def bpe(bpe_tokenizer_dir: Path) -> Any:
    return load_tokenizer(ModelConfig(name="t", init=ModelInit.random, tokenizer=str(bpe_tokenizer_dir)))


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["system", "multi_turn", "unicode"])
def test_peer_mask_equals_transformers_assistant_masks(bpe: Any, conv: List[Dict[str, str]]) -> None:
    """Our prefix-rendering spans give exactly HF's {% generation %} mask for the shipped chatml template."""
    ours = _encode(bpe, [{"messages": conv}], DataFormat.conversation, SHIPPED_TEMPLATES["chatml"])[0]
    peer = bpe.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                   chat_template=SHIPPED_TEMPLATES["chatml"])
    assert ours[0].tolist() == list(peer["input_ids"])
    assert ours[1].astype(int).tolist() == list(peer["assistant_masks"])
    assert ours[1].any() and not ours[1].all()


@pytest.mark.parametrize("name", sorted(SHIPPED_TEMPLATES))
def test_every_shipped_template_matches_the_peer(bpe: Any, name: str) -> None:
    for conv in CONVERSATIONS:
        ours = _encode(bpe, [{"messages": conv}], DataFormat.conversation, SHIPPED_TEMPLATES[name])[0]
        peer = bpe.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                       chat_template=SHIPPED_TEMPLATES[name])
        assert ours[1].astype(int).tolist() == list(peer["assistant_masks"])


def _trained_text(tok: Any, ids: np.ndarray, mask: np.ndarray) -> List[str]:
    """The trained runs of a document, decoded."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_conversation_train_on(bpe: Any) -> None:
    conv = CONVERSATIONS[1]
    ids, mask = _encode(bpe, [{"messages": conv}], DataFormat.conversation, SHIPPED_TEMPLATES["chatml"])[0]
    assert _trained_text(bpe, ids, mask) == ["A deque.<|im_end|>\n", "An OrderedDict, with order.<|im_end|>\n"]
    ids, mask = _encode(bpe, [{"messages": conv}], DataFormat.conversation, SHIPPED_TEMPLATES["chatml"],
                        TrainOn.last_assistant)[0]
    assert _trained_text(bpe, ids, mask) == ["An OrderedDict, with order.<|im_end|>\n"]
    ids, mask = _encode(bpe, [{"messages": conv}], DataFormat.conversation, SHIPPED_TEMPLATES["chatml"],
                        TrainOn.all)[0]
    assert mask.all()


def test_sharegpt_and_mapped_fields(bpe: Any) -> None:
    chatml = SHIPPED_TEMPLATES["chatml"]
    ref = _encode(bpe, [{"messages": CONVERSATIONS[0]}], DataFormat.conversation, chatml)[0]
    share = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                "value": m["content"]} for m in CONVERSATIONS[0]]}
    got = _encode(bpe, [share], DataFormat.conversation, chatml)[0]
    assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])
    mapped = {"dialog": [{"speaker": m["role"], "text": m["content"]} for m in CONVERSATIONS[0]]}
    got = _encode(bpe, [mapped], DataFormat.conversation, chatml,
                  fields={"messages": "dialog", "role": "speaker", "content": "text"})[0]
    assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])


def test_prompt_completion_plain_and_templated(bpe: Any) -> None:
    rec = {"prompt": "Q: capital of France?\nA:", "completion": " Paris."}
    ids, mask = _encode(bpe, [rec], DataFormat.prompt_completion, None)[0]
    assert ids[-1] == bpe.eos_token_id and mask[-1]
    assert bpe.decode(ids[mask][:-1]).strip() == "Paris."
    assert not mask[: len(bpe(rec["prompt"], add_special_tokens=False)["input_ids"]) - 1].any()
    ids, mask = _encode(bpe, [rec], DataFormat.prompt_completion, None, TrainOn.all)[0]
    assert mask.all()
    ids, mask = _encode(bpe, [{**rec, "system": "Be brief."}], DataFormat.prompt_completion,
                        SHIPPED_TEMPLATES["chatml"])[0]
    assert bpe.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: capital")
    assert _trained_text(bpe, ids, mask) == [" Paris.<|im_end|>\n"]
    # TRL's conversational prompt/completion: lists of messages
    conv = {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello"}]}
    ids, mask = _encode(bpe, [conv], DataFormat.prompt_completion, SHIPPED_TEMPLATES["chatml"])[0]
    assert _trained_text(bpe, ids, mask) == ["Hello<|im_end|>\n"]


def test_alpaca_plain_and_templated() -> None:
    tok = byte_level_tokenizer()
    rec = {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
    ids, mask = _encode(tok, [rec], DataFormat.alpaca, None)[0]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == ALPACA_PROMPT_NO_INPUT.format(instruction="Add 2 and 3.") + "5</s>"
    assert "### Response:" in text and tok.decode(ids[mask]) == "5</s>"
    ids, mask = _encode(tok, [{**rec, "input": "small numbers"}], DataFormat.alpaca, None)[0]
    assert "### Input:\nsmall numbers" in tok.decode(ids) and tok.decode(ids[mask]) == "5</s>"
    ids, mask = _encode(tok, [{**rec, "input": "x"}], DataFormat.alpaca, SHIPPED_TEMPLATES["chatml"])[0]
    assert tok.decode(ids).startswith("<|im_start|>user\nAdd 2 and 3.\n\nx<|im_end|>")
    assert tok.decode(ids[mask]) == "5<|im_end|>\n"
    ids, mask = _encode(tok, [rec], DataFormat.alpaca, None, TrainOn.all)[0]
    assert mask.all()


def _bad(tok: Any, record: Any, fmt: DataFormat, template: Optional[str], train_on: TrainOn = TrainOn.assistant) -> str:
    """The reason a record is refused, through the workers' code path."""
    spec = EncodeSpec(ModelConfig(name="t", init=ModelInit.random), FormatSpec(fmt, "text", {}, train_on, True, template),
                      False, 4096, Overlong.truncate)
    init_worker(spec, tok)
    res = encode_chunk(("mem", [(1, record)]))
    assert len(res.bad) == 1, res.bad
    return str(res.bad[0])


def test_alpaca_history_is_rendered_as_earlier_turns_or_refused_without_a_template() -> None:
    """LLaMA-Factory's alpaca ``history``: earlier [instruction, response] turns, never dropped without a word."""
    tok = byte_level_tokenizer()
    chatml = SHIPPED_TEMPLATES["chatml"]
    rec = {"instruction": "And times 3?", "output": "15", "system": "Be brief.",
           "history": [["What is 2 + 3?", "5"], ["Minus 1?", "4"]]}
    ids, mask = _encode(tok, [rec], DataFormat.alpaca, chatml)[0]
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                               "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nMinus 1?<|im_end|>\n"
                               "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd times 3?<|im_end|>\n"
                               "<|im_start|>assistant\n15<|im_end|>\n")
    assert _trained_text(tok, ids, mask) == ["5<|im_end|>\n", "4<|im_end|>\n", "15<|im_end|>\n"]
    ids, mask = _encode(tok, [rec], DataFormat.alpaca, chatml, TrainOn.last_assistant)[0]
    assert _trained_text(tok, ids, mask) == ["15<|im_end|>\n"]
    empty = _encode(tok, [{**rec, "history": []}], DataFormat.alpaca, chatml)[0]
    assert tok.decode(empty[0]).count("<|im_start|>user") == 1
    why = _bad(tok, rec, DataFormat.alpaca, None)
    assert "2 earlier turn(s) in 'history'" in why and "data.chat_template" in why
    assert "not an [instruction, response] pair" in _bad(tok, {**rec, "history": [["only one"]]}, DataFormat.alpaca, chatml)


def test_openai_weight_zero_leaves_an_assistant_message_untrained() -> None:
    tok = byte_level_tokenizer()
    chatml = SHIPPED_TEMPLATES["chatml"]
    conv = [dict(m) for m in CONVERSATIONS[1]]
    conv[1]["weight"] = 0
    ids, mask = _encode(tok, [{"messages": conv}], DataFormat.conversation, chatml)[0]
    assert _trained_text(tok, ids, mask) == ["An OrderedDict, with order.<|im_end|>\n"]
    assert "weight" not in tok.decode(ids)  # rendered as the other messages, the key not passed on
    plain = _encode(tok, [{"messages": CONVERSATIONS[1]}], DataFormat.conversation, chatml)[0]
    assert np.array_equal(ids, plain[0])
    conv[1]["weight"], conv[3]["weight"] = 1, 0
    ids, mask = _encode(tok, [{"messages": conv}], DataFormat.conversation, chatml, TrainOn.last_assistant)[0]
    assert _trained_text(tok, ids, mask) == ["A deque.<|im_end|>\n"]  # the last trained one
    conv[1]["weight"] = 0
    assert "every assistant message has weight 0" in _bad(tok, {"messages": conv}, DataFormat.conversation, chatml)
    conv[1]["weight"] = 0.5
    assert "has weight 0.5: 0 (not trained) or 1 (trained)" in _bad(tok, {"messages": conv}, DataFormat.conversation,
                                                                    chatml)
    user = [{**CONVERSATIONS[1][0], "weight": 0}, *CONVERSATIONS[1][1:]]
    assert "weights mark assistant messages only" in _bad(tok, {"messages": user}, DataFormat.conversation, chatml)


def test_text_format_trains_everything() -> None:
    tok = byte_level_tokenizer()
    ids, mask = _encode(tok, [{"text": "plain words"}], DataFormat.text, None, TrainOn.last_assistant)[0]
    assert mask.all() and tok.decode(ids) == "plain words</s>"


def test_byte_level_chatml_end_to_end(tmp_path: Path) -> None:
    """model.init=random, no tokenizer directory, data.chat_template=chatml: the cache masks as the template says."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cfg = make_cfg(tmp_path / "run", source=DataSource.jsonl, path=str(path), format=DataFormat.conversation,
                   chat_template="chatml", eval_fraction=0.0)
    p = prepare(cfg, num_workers=1, progress=False)
    tok = byte_level_tokenizer()
    tokens = np.load(p.path / "train" / "tokens.npy")
    labels = np.load(p.path / "train" / "labels.npy")
    offs = np.load(p.path / "train" / "doc_offsets.npy")
    trained = sorted(tok.decode(tokens[a:b][labels[a:b] != IGNORE_INDEX]) for a, b in zip(offs[:-1], offs[1:]))
    expected = sorted("".join(m["content"] + "<|im_end|>\n" for m in c if m["role"] == "assistant")
                      for c in CONVERSATIONS)
    assert trained == expected
    assert p.meta["chat_template"] == SHIPPED_TEMPLATES["chatml"]


# {% generation %} templates whose text between turns lies outside the markers: the mask must leave it out.
MARKED = {
    "chatml-newline-outside": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "default-system-and-trim": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}"
        "{{ '<|im_end|>' }}{% endgeneration %}\n{% else %}{{ message['content'] | trim + '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}"),
    "last-turn-differs": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% if loop.last %}{{ '<think></think>' }}{% endif %}"
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"),
}


@pytest.mark.parametrize("name", sorted(MARKED))
def test_generation_markers_give_exactly_transformers_assistant_mask(bpe: Any, name: str) -> None:
    """One render; the trained tokens are exactly return_assistant_tokens_mask, text after endgeneration untrained."""
    template = MARKED[name]
    for conv in CONVERSATIONS:
        ours = _encode(bpe, [{"messages": conv}], DataFormat.conversation, template)[0]
        peer = bpe.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                       chat_template=template)
        assert ours[0].tolist() == list(peer["input_ids"])
        assert ours[1].astype(int).tolist() == list(peer["assistant_masks"])
        trained = _trained_text(bpe, *ours)
        assert all(run.endswith("<|im_end|>") for run in trained)  # the newline between turns is not trained
