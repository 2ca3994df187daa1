"""Sequential calibration: layer by layer, each layer's weights read once per pass over the
calibration set and released before the next layer's are read."""

from __future__ import annotations

import re
import weakref
from collections import Counter

import pytest
import torch

from llmopt.compiler.calibration import LayerwiseRunner
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext, apply_passes
from llmopt.compiler.recipe import Recipe

LAYER = re.compile(r"layers\.(\d+)\.")


class ReadCounter:
    """Every read of a source weight: how often, and which layers' reads are alive at once."""

    def __init__(self):
        self.reads: Counter[str] = Counter()
        self.alive: Counter[int] = Counter()  # layer -> read tensors not yet freed
        self.most_layers_alive = 0

    def read(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.reads[name] += 1
        match = LAYER.match(name)
        if match:
            layer = int(match.group(1))
            self.alive[layer] += 1
            weakref.finalize(tensor, self._freed, layer)
            alive = sum(1 for count in self.alive.values() if count)
            self.most_layers_alive = max(self.most_layers_alive, alive)
        return tensor

    def _freed(self, layer: int) -> None:
        self.alive[layer] -= 1


def lazy(path) -> tuple[ModelIR, ReadCounter]:
    """The checkpoint as the compiler streams it, each read from its file counted."""
    ir, counter = load_checkpoint(str(path)), ReadCounter()
    source = ir.weights.source
    assert source is not None, "the loader reads safetensors lazily"
    read, row_blocks = source.read, source.row_blocks
    source.read = lambda name: counter.read(name, read(name))

    def counted_blocks(name: str, rows: int):  # one pass over a tensor's rows: one read
        counter.reads[name] += 1
        yield from row_blocks(name, rows)

    source.row_blocks = counted_blocks
    return ir, counter


def eager(path) -> ModelIR:
    """The whole model resident in float32, as the compiler held it before streaming."""
    ir = load_checkpoint(str(path))
    ir.weights = {name: ir.weights[name] for name in ir.weights}
    return ir


def recipe(step: dict, text, samples: int = 8) -> Recipe:
    """Calibration on the text alone: what a model too large to sample calibrates on."""
    return Recipe(model="m", passes=[step], quality={"measure": False},
                  calibration={"text": str(text), "samples": samples, "seq_len": 32,
                               "model_samples": 0})


def codes(ir: ModelIR) -> dict[str, tuple[torch.Tensor, ...]]:
    return {n: (q.codes, q.scales, q.zeros) for n, q in ir.quantized.items()}


CALIBRATING = [
    {"gptq": {"bits": 4, "group_size": 32, "include_lm_head": False}},
    {"gptq": {"bits": 4, "group_size": 32, "act_order": False, "include_lm_head": True}},
    {"awq": {"bits": 4, "group_size": 32, "include_lm_head": True}},
]


@pytest.mark.parametrize("step", CALIBRATING, ids=lambda s: str(s))
def test_lazily_read_weights_give_the_same_codes_one_layer_at_a_time(
        tiny_checkpoints, word_text, step):
    expected, _ = apply_passes(eager(tiny_checkpoints["llama"]), recipe(step, word_text).passes,
                               PassContext(recipe(step, word_text), lambda _: None))
    source, counter = lazy(tiny_checkpoints["llama"])
    got, _ = apply_passes(source, recipe(step, word_text).passes,
                          PassContext(recipe(step, word_text), lambda _: None))
    assert codes(got).keys() == codes(expected).keys()
    for name, tensors in codes(expected).items():
        for a, b in zip(codes(got)[name], tensors, strict=True):
            assert torch.equal(a, b), name
    assert counter.most_layers_alive == 1


@pytest.mark.parametrize("step", CALIBRATING, ids=lambda s: str(s))
def test_each_layer_is_read_a_fixed_number_of_times_whatever_the_calibration_size(
        tiny_checkpoints, word_text, step):
    counts = []
    for samples in (8, 32):  # one batch of 8 windows, then four
        ir, counter = lazy(tiny_checkpoints["llama"])
        apply_passes(ir, recipe(step, word_text, samples).passes,
                     PassContext(recipe(step, word_text, samples), lambda _: None))
        counts.append(counter.reads)
    assert counts[0] == counts[1]
    (options,) = step.values()  # the tied head, read again to quantize it
    head = int(options.get("include_lm_head") is not False)
    assert counts[0]["embed_tokens"] == 1 + head


def test_kv_cache_static_scales_hold_one_layer_at_a_time(tiny_checkpoints, word_text):
    step = {"kv_cache": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel"}}
    expected, _ = apply_passes(eager(tiny_checkpoints["llama"]), recipe(step, word_text).passes,
                               PassContext(recipe(step, word_text), lambda _: None))
    ir, counter = lazy(tiny_checkpoints["llama"])
    got, _ = apply_passes(ir, recipe(step, word_text).passes,
                          PassContext(recipe(step, word_text), lambda _: None))
    scales = [n for n in expected.weights if n.endswith("_cache_scale")]
    assert scales and all(torch.equal(got.weights[n], expected.weights[n]) for n in scales)
    assert counter.most_layers_alive == 1


def test_the_runner_reads_a_layer_once_per_pass_over_the_set(tiny_checkpoints):
    ir, counter = lazy(tiny_checkpoints["llama"])
    runner = LayerwiseRunner(ir, torch.randint(0, 50, (24, 16)), batch_size=8)
    runner.run_layer()
    assert counter.reads["layers.0.q_proj.weight"] == 1  # three batches, one read
    runner.advance()
    assert counter.reads["layers.0.q_proj.weight"] == 2
    assert counter.reads["layers.1.q_proj.weight"] == 0
