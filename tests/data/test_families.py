"""Real chat families: the stock templates (tests/data/templates, verbatim) with tokenizers carrying their tokens.

The oracle is independent of fsdp_workflow.data.spans: per family, a hand-written
rule finds each assistant turn by its header in the rendering (``open``), skips
an empty think block the template adds itself, and ends the span after the
family's end-of-turn string. Tokens overlapping those spans (transformers' rule
for assistant masks) must be exactly the tokens the prepare step trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

from fsdp_workflow.config.schema import DataFormat, DataSource, ModelConfig, ModelInit, OnBadRecord, Overlong, TrainOn
from fsdp_workflow.data.cache import IGNORE_INDEX
from fsdp_workflow.data.encode import EncodeSpec, encode_chunk, init_worker
from fsdp_workflow.data.formats import FormatSpec
from fsdp_workflow.data.prepare import prepare

from .conftest import CORPUS, make_cfg, write_jsonl

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class Family:
    """A chat family: its template file, its special tokens, and the oracle's rule."""

    template: str
    specials: Tuple[str, ...]  # special tokens of the real tokenizer (the template's markers)
    eos: str
    bos: Optional[str]
    open: str  # what precedes an assistant answer in the rendering
    eot: str  # the family's end-of-turn string: must be trained
    system: bool = True  # the template accepts a system turn
    empty_think: str = ""  # a think block the template inserts on its own (never trained)
    reasoning: str = ""  # how the template reads reasoning: "field" (reasoning_content), "content" (<think> in it)
    plain: Tuple[str, ...] = field(default_factory=tuple)  # added, not special (Qwen3's <think>)


LLAMA = dict(specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
             eos="<|eot_id|>", bos="<|begin_of_text|>", open="<|start_header_id|>assistant<|end_header_id|>\n\n",
             eot="<|eot_id|>")
QWEN = dict(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", bos=None,
            open="<|im_start|>assistant\n", eot="<|im_end|>")
MISTRAL = dict(specials=("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), eos="</s>", bos="<s>", eot="</s>")
GEMMA = dict(specials=("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), eos="<eos>", bos="<bos>",
             open="<start_of_turn>model\n", eot="<end_of_turn>")
PHI3 = dict(specials=("<s>", "</s>", "<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"),
            eos="<|endoftext|>", bos="<s>", open="<|assistant|>\n", eot="<|end|>")
DEEPSEEK = dict(specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
                eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>", open="<｜Assistant｜>",
                eot="<｜end▁of▁sentence｜>", reasoning="content", plain=("<think>", "</think>"))

FAMILIES: Dict[str, Family] = {
    "llama3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", **LLAMA),
    "llama3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", **LLAMA),
    "llama3.3": Family("meta-llama-Llama-3.3-70B-Instruct.jinja", **LLAMA),
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct.jinja", **QWEN),
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", **QWEN, empty_think="<think>\n\n</think>\n\n", reasoning="field",
                    plain=("<think>", "</think>")),
    "qwen3-think-in-content": Family("Qwen-Qwen3-0.6B.jinja", **QWEN, empty_think="<think>\n\n</think>\n\n",
                                     reasoning="content", plain=("<think>", "</think>")),
    "mistral-v0.3": Family("mistralai-Mistral-7B-Instruct-v0.3.jinja", **MISTRAL, open="[/INST] "),
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja", **MISTRAL, open="[/INST]"),
    "gemma2": Family("google-gemma-2-2b-it.jinja", **GEMMA, system=False),
    "gemma3": Family("google-gemma-3-it.jinja", **GEMMA),
    "phi3": Family("microsoft-Phi-3-mini-instruct.jinja", **PHI3),
    "phi3.5": Family("microsoft-Phi-3.5-mini-instruct.jinja", **PHI3),
    "phi4": Family("microsoft-phi-4.jinja", specials=("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"),
                   eos="<|im_end|>", bos="<|endoftext|>", open="<|im_start|>assistant<|im_sep|>", eot="<|im_end|>"),
    "deepseek-r1": Family("deepseek-ai-DeepSeek-R1.jinja", **DEEPSEEK),
    "deepseek-r1-distill": Family("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", **DEEPSEEK),
}

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
EXCHANGES = [("What is 2 + 2?", "It is 4."), ("And doubled?", "Eight, that is 8."),
             ("Name a river in Japan.", "The Shinano, 信濃川 — the longest.")]
REASONING = ["Two plus two is four.", "Four doubled is eight.", "Recall Japanese rivers."]


def conversation(family: Family, exchanges: int, system: bool, reasoning: bool) -> List[Dict[str, Any]]:
    msgs: List[Dict[str, Any]] = [dict(SYSTEM)] if system else []
    for i, (q, a) in enumerate(EXCHANGES[:exchanges]):
        msgs.append({"role": "user", "content": q})
        if reasoning and family.reasoning == "field":
            msgs.append({"role": "assistant", "content": a, "reasoning_content": REASONING[i]})
        elif reasoning:
            msgs.append({"role": "assistant", "content": f"<think>\n{REASONING[i]}\n</think>\n\n{a}"})
        else:
            msgs.append({"role": "assistant", "content": a})
    return msgs


def make_tokenizer(family: Family, directory: Path) -> Any:
    """A byte-level BPE trained on the shipped corpus, holding the family's tokens and its template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(family.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(CORPUS)], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=family.eos, bos_token=family.bos)
    fast.chat_template = (TEMPLATES / family.template).read_text()
    fast.save_pretrained(directory)
    return fast


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Tuple[Any, Path]]:
    out = {}
    for name, fam in FAMILIES.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = (make_tokenizer(fam, d), d)
    return out


def oracle_spans(family: Family, text: str) -> List[Tuple[int, int]]:
    """Hand rule: after each assistant header, skip the template's own empty think block, end after the EOT."""
    spans, i = [], 0
    while True:
        h = text.find(family.open, i)
        if h < 0:
            return spans
        start = h + len(family.open)
        if family.empty_think and text.startswith(family.empty_think, start):
            start += len(family.empty_think)
        end = text.find(family.eot, start)
        if end < 0:  # a header with no answer after it (Mistral's [/INST] closing the last user turn)
            return spans
        end += len(family.eot)
        spans.append((start, end))
        i = end


def overlap_mask(offsets: List[Tuple[int, int]], spans: List[Tuple[int, int]]) -> List[int]:
    return [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]


def encode(tokenizer: Any, template: str, records: List[Any], train_on: TrainOn = TrainOn.assistant) -> Any:
    spec = EncodeSpec(ModelConfig(name="t", init=ModelInit.random),
                      FormatSpec(DataFormat.conversation, "text", {}, train_on, True, template), False, 1 << 20,
                      Overlong.truncate)
    init_worker(spec, tokenizer)
    return encode_chunk(("mem.jsonl", list(enumerate(records, 1))))


CASES = [(name, n, system, reasoning) for name, fam in FAMILIES.items() for n in (1, 3)
         for system in ((False, True) if fam.system else (False,))
         for reasoning in ((False, True) if fam.reasoning else (False,))]


@pytest.mark.parametrize("name,exchanges,system,reasoning", CASES,
                         ids=[f"{c[0]}-{c[1]}x{'-system' if c[2] else ''}{'-reasoning' if c[3] else ''}"
                              for c in CASES])
def test_family_trains_each_answer_and_its_end_of_turn(tokenizers: Dict[str, Tuple[Any, Path]], name: str,
                                                       exchanges: int, system: bool, reasoning: bool) -> None:
    fam = FAMILIES[name]
    tok, _ = tokenizers[name]
    conv = conversation(fam, exchanges, system, reasoning)
    res = encode(tok, tok.chat_template, [{"messages": conv}])
    assert not res.bad, res.bad
    text = tok.apply_chat_template(conv, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert res.tokens.tolist() == enc["input_ids"]  # one render, the same text as transformers
    spans = oracle_spans(fam, text)
    assert len(spans) == exchanges
    expected = overlap_mask(enc["offset_mapping"], spans)
    got = (res.labels != IGNORE_INDEX).astype(int).tolist()
    assert got == expected
    eot_id = tok.convert_tokens_to_ids(fam.eot)
    trained = res.tokens[res.labels != IGNORE_INDEX].tolist()
    assert trained.count(eot_id) == exchanges  # every turn teaches the model to stop
    for (a, b), (_, answer) in zip(spans, EXCHANGES):
        assert text[a:b].endswith(answer.strip() + fam.eot)
    trained_text = tok.decode(trained)
    for header in ("system", "user", "You are a careful", "Cutting Knowledge", "You are Qwen", fam.open.strip(),
                   fam.empty_think or "<think>\n\n</think>"):  # template text is never trained
        assert header not in trained_text


def test_reasoning_is_trained_where_the_template_writes_it(tokenizers: Dict[str, Tuple[Any, Path]]) -> None:
    """Qwen3 writes reasoning for the turn after the last question: trained, with its think tags."""
    tok, _ = tokenizers["qwen3"]
    conv = conversation(FAMILIES["qwen3"], 2, False, True)
    res = encode(tok, tok.chat_template, [{"messages": conv}])
    trained = tok.decode(res.tokens[res.labels != IGNORE_INDEX])
    assert f"<think>\n{REASONING[1]}\n</think>\n\n{EXCHANGES[1][1]}<|im_end|>" in trained
    assert REASONING[0] not in tok.decode(res.tokens)  # the template drops earlier reasoning


def test_empty_think_block_is_not_trained(tokenizers: Dict[str, Tuple[Any, Path]]) -> None:
    tok, _ = tokenizers["qwen3"]
    conv = conversation(FAMILIES["qwen3"], 1, False, False)
    res = encode(tok, tok.chat_template, [{"messages": conv}])
    assert "<think>" in tok.decode(res.tokens)
    assert tok.decode(res.tokens[res.labels != IGNORE_INDEX]) == EXCHANGES[0][1] + "<|im_end|>"


def test_gemma2_system_turn_is_a_bad_record_named_by_line(tmp_path: Path,
                                                            tokenizers: Dict[str, Tuple[Any, Path]]) -> None:
    """Gemma 2's template raises on a system turn: that record is named by file:line; skip leaves it out."""
    _, d = tokenizers["gemma2"]
    good = {"messages": conversation(FAMILIES["gemma2"], 1, False, False)}
    bad = {"messages": [dict(SYSTEM)] + good["messages"]}
    path = write_jsonl(tmp_path / "g.jsonl", [good, bad, good])
    cfg = make_cfg(tmp_path / "run", tokenizer=str(d), source=DataSource.jsonl, path=str(path),
                   format=DataFormat.conversation, eval_fraction=0.0)
    cfg.model.vocab_size = 1024
    from fsdp_workflow.data.sources import DataError

    with pytest.raises(DataError, match=r"g\.jsonl:2: the chat template refused this conversation.*System role"):
        prepare(cfg, num_workers=1, progress=False)
    cfg.data.on_bad_record = OnBadRecord.skip
    p = prepare(cfg, num_workers=1, progress=False)
    assert p.meta["bad_records"] == 1 and p.meta["splits"]["train"]["documents"] == 2


@pytest.mark.parametrize("name", ["qwen3", "phi3", "mistral-nemo"])
def test_prefix_divergent_templates_prepare_end_to_end(tmp_path: Path, tokenizers: Dict[str, Tuple[Any, Path]],
                                                       name: str) -> None:
    """The templates whose prefixes render differently from the whole, through prepare with the tokenizer's template."""
    fam = FAMILIES[name]
    tok, d = tokenizers[name]
    convs = [conversation(fam, n, s, False) for n in (1, 2, 3) for s in (False, True)]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    cfg = make_cfg(tmp_path / "run", tokenizer=str(d), source=DataSource.jsonl, path=str(path),
                   format=DataFormat.conversation, eval_fraction=0.0)
    cfg.model.vocab_size = 1024
    p = prepare(cfg, num_workers=2, progress=False)
    assert p.meta["bad_records"] == 0 and p.meta["splits"]["train"]["documents"] == len(convs)
    tokens = np.load(p.path / "train" / "tokens.npy")
    labels = np.load(p.path / "train" / "labels.npy")
    eot_id = tok.convert_tokens_to_ids(fam.eot)
    assert int(((labels != IGNORE_INDEX) & (tokens == eot_id)).sum()) == sum(n for n in (1, 2, 3) for _ in (0, 1))


@pytest.mark.parametrize("name", ["mistral-nemo", "qwen2.5", "llama3.1", "phi3", "gemma3"])
def test_conversation_ending_with_a_user_turn(tokenizers: Dict[str, Tuple[Any, Path]], name: str) -> None:
    """Mistral-Nemo then writes the system prompt into that last user turn, after the earlier answers."""
    fam = FAMILIES[name]
    tok, _ = tokenizers[name]
    conv = conversation(fam, 2, True, False) + [{"role": "user", "content": "Thanks!"}]
    res = encode(tok, tok.chat_template, [{"messages": conv}])
    assert not res.bad, res.bad
    text = tok.apply_chat_template(conv, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert (res.labels != IGNORE_INDEX).astype(int).tolist() == overlap_mask(enc["offset_mapping"],
                                                                              oracle_spans(fam, text))


def test_an_answer_that_also_occurs_in_the_templates_own_text(tokenizers: Dict[str, Tuple[Any, Path]]) -> None:
    """Qwen2.5's default system prompt ends "You are a helpful assistant.": the same answer is found in its turn."""
    tok, _ = tokenizers["qwen2.5"]
    conv = [{"role": "user", "content": "You"}, {"role": "assistant", "content": "You are a helpful assistant."}]
    res = encode(tok, tok.chat_template, [{"messages": conv}])
    text = tok.apply_chat_template(conv, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert (res.labels != IGNORE_INDEX).astype(int).tolist() == overlap_mask(enc["offset_mapping"],
                                                                              oracle_spans(FAMILIES["qwen2.5"], text))
