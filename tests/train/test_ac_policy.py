"""Which forward ops each ``strategy.activation_checkpointing`` mode runs again in backward, eager and compiled.

One process, no FSDP: the tiny Llama's shape (hidden 64, 4 heads of 16, 2 KV heads,
intermediate 176, 2 layers) with the trainer's loss forward, wrapped by
:func:`apply_activation_checkpointing` as the trainer wraps it. A dispatch mode counts
the ops of one backward; what a mode adds over ``none`` is what it recomputed. Each
matmul is named by its weight's shape (in, out): q and o are (64, 64), k and v
(64, 32), gate and up (64, 176).

Under ``train.compile`` the wrapper is compiled (:func:`compile_units`), here with
the ``aot_eager`` backend: AOTAutograd's partitioner, which applies the policy's tags,
without inductor's C++ build, so the backward graph's ops are still visible to the
counter. The 2-rank FSDP2 check that every mode trains exactly as ``none`` is
tests/train/test_activation_checkpointing.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_workflow.config.schema import ActivationCheckpointing as AC
from fsdp_workflow.train.activation_checkpointing import apply_activation_checkpointing, compile_unit, compile_units
from fsdp_workflow.train.loss import install_loss_forward

SEQ, LAYERS = 32, 2
Q_O, K_V, GATE_UP = (64, 64), (64, 32), (64, 176)
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


class BackwardOps(TorchDispatchMode):
    """Counts ops by name, and matmuls by (in, out) of their weight."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[(name, tuple(args[1].shape)) if name == "mm" else name] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: AC, compiled: bool = False) -> Counter:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=176,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2))
    apply_activation_checkpointing(model, [LlamaDecoderLayer], mode, every_n_layers=2)
    if compiled:
        for unit in compile_units(model, [LlamaDecoderLayer]):
            compile_unit(unit, backend="aot_eager", fullgraph=True)
    install_loss_forward(model)
    ids = torch.randint(0, 260, (2, SEQ))
    loss = model(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ).expand(2, SEQ)).ce
    counter = BackwardOps()
    with counter:
        loss.backward()
    return counter.ops


def recomputed(mode: AC, baseline: Counter, compiled: bool = False) -> Counter:
    """The ops ``mode`` adds to backward over ``baseline`` (``none``'s): its recomputation."""
    extra = backward_ops(mode, compiled)
    extra.subtract(baseline)
    assert all(n >= 0 for n in extra.values()), extra  # no mode runs fewer backward ops than none
    return +extra


def matmuls(ops: Counter) -> Counter:
    return Counter({key[1]: n for key, n in ops.items() if isinstance(key, tuple)})


@pytest.fixture(scope="module")
def baseline() -> Counter:
    """``none``'s backward, eager. Compiled with aot_eager, its matmuls are the same (checked when written)."""
    return backward_ops(AC.none)


@pytest.fixture(scope="module")
def eager(baseline: Counter) -> dict:
    return {mode: recomputed(mode, baseline) for mode in (AC.full, AC.every_n_layers, AC.ops)}


def test_full_reruns_every_layer_forward(eager: dict) -> None:
    # q, k, v, o, gate, up and attention; not down_proj (the non-reentrant recompute stops once backward
    # has what it needs, and nothing reads down_proj's output).
    assert matmuls(eager[AC.full]) == Counter({Q_O: 2 * LAYERS, K_V: 2 * LAYERS, GATE_UP: 2 * LAYERS})
    assert eager[AC.full][SDPA] == LAYERS


def test_every_n_layers_reruns_half_the_layers(eager: dict) -> None:
    assert matmuls(eager[AC.every_n_layers]) == Counter({Q_O: 2, K_V: 2, GATE_UP: 2})  # layer 1 of 0, 1
    assert eager[AC.every_n_layers][SDPA] == 1


def test_ops_keeps_every_second_matmul_and_attention(eager: dict) -> None:
    # Forward runs q, k, v, o, gate, up, down; ops keeps k, o, up (the even ones; down's output is never
    # read) and reruns q, v and gate: one of each shape per layer. Attention is kept.
    ops = eager[AC.ops]
    assert matmuls(ops) == Counter({Q_O: LAYERS, K_V: LAYERS, GATE_UP: LAYERS})
    assert ops[SDPA] == 0
    assert ops["rsqrt"] == 2 * LAYERS  # both RMSNorms of each layer recomputed, as in full
    assert ops["silu"] == LAYERS


def test_ops_policy_applies_under_compile(baseline: Counter) -> None:
    # Compiled as the trainer compiles it (the wrapper, the checkpoint inside the graph; fullgraph=True:
    # a graph break on the policy fails here), ops reruns the same three matmuls per layer, no attention.
    ops = backward_ops(AC.ops, compiled=True)
    assert matmuls(ops) - matmuls(baseline) == Counter({Q_O: LAYERS, K_V: LAYERS, GATE_UP: LAYERS}), ops
    assert ops[SDPA] == 0


def test_a_graph_break_is_summarised_for_the_log() -> None:
    """What the trainer logs after its first compiled step: nothing when the layers compiled whole
    (the test above, fullgraph), the break and its reason when one did not."""
    from fsdp_workflow.train.activation_checkpointing import graph_break_summary

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = torch.nn.Linear(4, 4)
    compile_unit(layer, backend="aot_eager")
    layer(torch.ones(2, 4))
    assert graph_break_summary() is None

    class Breaks(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return x * 2

    unit = Breaks()
    compile_unit(unit, backend="aot_eager")
    unit(torch.ones(2))
    summary = graph_break_summary()
    assert summary is not None and "1 time(s)" in summary and "graph_break" in summary, summary
    torch._dynamo.utils.counters.clear()
