"""A mixed chat corpus built from seeds in this file: English chat, code with unicode and emoji, Chinese and Japanese.

Used by ``data_prepare_bench.py --corpus mixed``. Deterministic for a seed, no
downloads: a third of the conversations are English (words of the shipped
smoke corpus, as the ASCII benchmark), a third ask for and answer with code
whose strings, comments and identifiers carry accents, Greek, Cyrillic, CJK,
curly quotes, arrows and emoji (flags, skin tones, ZWJ sequences, a variation
selector), and a third are Chinese or Japanese chat, where words are long runs
without spaces between full-width punctuation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Dict, List

# Chinese and Japanese words, joined into clauses at random: a clause between two punctuation marks is one
# pre-tokenizer word, so nearly every clause is new (real CJK text repeats few of them; a word cache must cope)
ZH_WORDS = ("我们 你们 他们 模型 数据 训练 分布式 显卡 进程 梯度 参数 优化器 状态 检查点 学习率 损失 批次 节点 网络 带宽 日志 "
            "程序 问题 方法 结果 时间 今天 明天 已经 需要 可以 应该 如果 因为 所以 但是 然后 首先 其次 最后 一般 通常 大约 "
            "非常 比较 重新 同步 切分 保存 恢复 计算 检查 设置 降低 提高 打开 关闭 使用 处理 分析 确认 报错 卡住 运行 "
            "天气 北京 上海 图书馆 周末 朋友 书 历史 机器学习 中文 对话 分词器 汉字 准确率 验证集 显存 精度 浮点数 规约 "
            "的 了 在 是 和 把 被 给 从 到 对 也 都 就 还 又 很 不 没有 一些 每个 这个 那个 自己 一下 起来 出来").split()
ZH_ENDS = ("。", "？", "！", "；")
JA_NOUNS = ("データ モデル 学習 分散 プロセス 勾配 パラメータ メモリ チェックポイント 学習率 損失 バッチ ノード ネットワーク ログ "
            "エラー コード 問題 方法 結果 時間 今日 明日 東京 京都 週末 友達 本 歴史 機械学習 日本語 文 単語 正解率 評価 "
            "会議 資料 フォルダ 通信 順番 設定 値 様子 計算 再開 保存").split()
JA_PARTICLES = ("は が を に で と の から まで も へ より").split()
JA_VERBS = ("します できます なります あります います 思います 始めます 見てください 教えてください 確認しましょう "
            "止まりました 上がりました 直せば動きます 使います 分けます 置きます 保存されます 平均されます 行く予定です").split()
JA_ENDS = ("。", "？", "！", "ね。", "よ。")
GREETINGS = ["Grüße", "¡Hola", "Привет", "Γειά σου", "你好", "こんにちは", "Ça va", "naïve café", "Ωmega", "안녕하세요",
             "Tschüß", "Olá", "Cześć", "Merhaba", "שלום", "مرحبا", "नमस्ते", "Xin chào"]
SYMBOLS = ["→", "…", "≤ 3 µs", "±0.5°C", "“quoted”", "‘single’", "—", "✓", "×", "€12,50", "½", "∑ x²", "λ", "©"]
EMOJI = ["🚀", "✅", "🎉", "👍🏽", "👩\u200d💻", "🇯🇵", "❤️", "🔥", "😀", "🤖", "📦", "⚠️", "🧪", "👨\u200d👩\u200d👧"]
CODE = [
    'def {name}({arg}: str) -> str:\n    """{doc}"""\n    # {comment}\n    return f"{greet}, {{{arg}}} {emoji}"\n',
    'const {name} = ({arg}) => {{\n  // {comment}\n  console.log(`{greet} ${{{arg}}} {symbol}`);\n'
    '  return "{emoji}";\n}};\n',
    'fn {name}({arg}: &str) -> String {{\n    // {comment}\n    format!("{greet} {{}} {symbol}", {arg})\n}}\n',
    'class {cls}:\n    """{doc} {emoji}"""\n\n'
    '    def __init__(self, {arg}="{greet}"):\n        self.{arg} = {arg}  # {comment}\n',
    'SELECT {arg}, COUNT(*) AS n  -- {comment}\nFROM {name}\nWHERE label = \'{greet} {emoji}\'\nGROUP BY {arg};\n',
    '{name}:\n  {arg}: "{greet} {symbol}"  # {comment}\n  icon: "{emoji}"\n',
]
ASKS = ["Write a {lang} function that prints {greet} with {emoji}.", "Why does this {lang} code print {symbol} wrong?",
        "请用{lang}写一个函数，输出“{greet}”。", "この{lang}のコードを直してください {emoji}",
        "Can you add a comment in Chinese to this {lang}?"]
LANGS = ["Python", "JavaScript", "Rust", "Python", "SQL", "YAML"]


def _code(rng: random.Random, words: List[str]) -> str:
    pick = rng.choice
    snake = "_".join(pick(words).lower().strip(".,:;()*") or "x" for _ in range(2))
    name = "".join(c for c in snake if c.isalnum() or c == "_") or "f"
    return pick(CODE).format(
        name=name, arg=pick(["name", "user", "text", "città", "größe", "值"]), cls=name.title().replace("_", ""),
        doc=" ".join(rng.choices(words, k=rng.randint(3, 9))), greet=pick(GREETINGS), emoji=pick(EMOJI),
        symbol=pick(SYMBOLS), comment=pick([_zh(rng), _ja(rng), " ".join(rng.choices(words, k=6)) + " " + pick(EMOJI)]))


def english(rng: random.Random, words: List[str]) -> List[Dict[str, str]]:
    """One English conversation: half with a system turn, 1-3 exchanges of ``words`` (the ASCII benchmark's)."""
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": " ".join(rng.choices(words, k=rng.randint(5, 20)))})
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(10, 60)))})
        msgs.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(20, 150)))})
    return msgs


def _coding(rng: random.Random, words: List[str]) -> List[Dict[str, str]]:
    msgs = []
    for _ in range(rng.randint(1, 3)):
        lang = rng.choice(LANGS)
        ask = rng.choice(ASKS).format(lang=lang, greet=rng.choice(GREETINGS), emoji=rng.choice(EMOJI),
                                      symbol=rng.choice(SYMBOLS))
        answer = [" ".join(rng.choices(words, k=rng.randint(5, 25))) + f" {rng.choice(EMOJI)}"]
        for _ in range(rng.randint(1, 4)):
            answer.append(f"```{lang.lower()}\n{_code(rng, words)}```")
        msgs.append({"role": "user", "content": ask})
        msgs.append({"role": "assistant", "content": "\n\n".join(answer)})
    return msgs


def _zh(rng: random.Random) -> str:
    clauses = ["".join(rng.choices(ZH_WORDS, k=rng.randint(3, 8))) for _ in range(rng.randint(1, 3))]
    return "，".join(clauses) + rng.choice(ZH_ENDS)


def _ja(rng: random.Random) -> str:
    clauses = ["".join(rng.choice(JA_NOUNS) + rng.choice(JA_PARTICLES) for _ in range(rng.randint(1, 3)))
               + rng.choice(JA_VERBS) for _ in range(rng.randint(1, 2))]
    return "、".join(clauses) + rng.choice(JA_ENDS)


def _cjk(rng: random.Random) -> List[Dict[str, str]]:
    sentence = _zh if rng.random() < 0.5 else _ja
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": sentence(rng) + sentence(rng)})
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": "".join(sentence(rng) for _ in range(rng.randint(1, 4)))})
        answer = "".join(sentence(rng) for _ in range(rng.randint(4, 16)))
        if rng.random() < 0.3:
            answer += f"\n\n1. GPU × {rng.randint(2, 64)}\n2. seq_len = {rng.choice([2048, 4096, 8192])}"
        msgs.append({"role": "assistant", "content": answer})
    return msgs


def conversations(words: List[str], seed: int = 0) -> Callable[[], List[Dict[str, str]]]:
    """A function returning the next conversation: English, code and CJK in turn (a third each)."""
    rng = random.Random(seed)
    kinds = [lambda: english(rng, words), lambda: _coding(rng, words), lambda: _cjk(rng)]
    state = {"i": 0}

    def next_one() -> List[Dict[str, str]]:
        msgs = kinds[state["i"] % 3]()
        state["i"] += 1
        return msgs

    return next_one


def write(path: Path, words: List[str], n: int, seed: int = 0) -> Any:
    """Write ``n`` mixed conversations to ``path`` as JSONL (``ensure_ascii=False``: UTF-8 as exports write it)."""
    nxt = conversations(words, seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(n):
            fh.write(json.dumps({"messages": nxt()}, ensure_ascii=False) + "\n")
    return n
