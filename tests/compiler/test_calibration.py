"""Sequential calibration: layer by layer, each layer's weights read once per pass over the
calibration set and released before the next layer's are read."""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections import Counter
from collections.abc import Iterator, MutableMapping

import pytest
import torch

from llmopt.compiler.calibration import LayerwiseRunner, calibration_memory_bytes
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
        copy = tensor.clone()  # a fresh tensor per read, as a lazy checkpoint reader gives
        self.reads[name] += 1
        match = LAYER.match(name)
        if match:
            layer = int(match.group(1))
            self.alive[layer] += 1
            weakref.finalize(copy, self._freed, layer)
            alive = sum(1 for count in self.alive.values() if count)
            self.most_layers_alive = max(self.most_layers_alive, alive)
        return copy

    def _freed(self, layer: int) -> None:
        self.alive[layer] -= 1


class LazyWeights(MutableMapping):
    """Source weights read on access (counted); what passes write is kept beside them."""

    def __init__(self, source: dict[str, torch.Tensor], counter: ReadCounter,
                 written: dict[str, torch.Tensor] | None = None,
                 removed: set[str] | None = None):
        self.source, self.counter = source, counter
        self.written, self.removed = dict(written or {}), set(removed or ())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.written:
            return self.written[name]
        if name in self.removed or name not in self.source:
            raise KeyError(name)
        return self.counter.read(name, self.source[name])

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.written[name] = tensor
        self.removed.discard(name)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.written.pop(name, None)
        self.removed.add(name)

    def __contains__(self, name: object) -> bool:
        return name in self.written or (name in self.source and name not in self.removed)

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self.source if n not in self.removed and n not in self.written)
        yield from self.written

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclasses.dataclass
class LazyIR(ModelIR):
    """A ModelIR over `LazyWeights` whose copies share the source (nothing read to copy)."""

    def copy(self) -> LazyIR:
        w = self.weights
        return dataclasses.replace(self, weights=LazyWeights(w.source, w.counter, w.written,
                                                             w.removed),
                                   annotations=dict(self.annotations),
                                   quantized=dict(self.quantized))


def lazy(ir: ModelIR) -> tuple[LazyIR, ReadCounter]:
    counter = ReadCounter()
    fields = {f.name: getattr(ir, f.name) for f in dataclasses.fields(ir)}
    fields["weights"] = LazyWeights(dict(ir.weights), counter)
    return LazyIR(**fields), counter


def recipe(step: dict, text, samples: int = 8) -> Recipe:
    return Recipe(model="m", passes=[step], quality={"measure": False},
                  calibration={"text": str(text), "samples": samples, "seq_len": 32})


def codes(ir: ModelIR) -> dict[str, tuple[torch.Tensor, ...]]:
    return {n: (q.codes, q.scales, q.zeros) for n, q in ir.quantized.items()}


CALIBRATING = [
    {"gptq": {"bits": 4, "group_size": 32}},
    {"gptq": {"bits": 4, "group_size": 32, "act_order": False, "include_lm_head": True}},
    {"awq": {"bits": 4, "group_size": 32, "include_lm_head": True}},
]


@pytest.mark.parametrize("step", CALIBRATING, ids=lambda s: str(s))
def test_lazily_read_weights_give_the_same_codes_one_layer_at_a_time(
        tiny_checkpoints, word_text, step):
    eager = load_checkpoint(str(tiny_checkpoints["llama"]))
    expected, _ = apply_passes(eager, recipe(step, word_text).passes,
                               PassContext(recipe(step, word_text), lambda _: None))
    source, counter = lazy(load_checkpoint(str(tiny_checkpoints["llama"])))
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
        ir, counter = lazy(load_checkpoint(str(tiny_checkpoints["llama"])))
        apply_passes(ir, recipe(step, word_text, samples).passes,
                     PassContext(recipe(step, word_text, samples), lambda _: None))
        counts.append(counter.reads)
    assert counts[0] == counts[1]
    head = 1 if "lm_head" in str(step) else 0  # the tied head, read again to quantize it
    assert counts[0]["embed_tokens"] == 1 + head


def test_kv_cache_static_scales_hold_one_layer_at_a_time(tiny_checkpoints, word_text):
    step = {"kv_cache": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel"}}
    eager = load_checkpoint(str(tiny_checkpoints["llama"]))
    expected, _ = apply_passes(eager, recipe(step, word_text).passes,
                               PassContext(recipe(step, word_text), lambda _: None))
    ir, counter = lazy(load_checkpoint(str(tiny_checkpoints["llama"])))
    got, _ = apply_passes(ir, recipe(step, word_text).passes,
                          PassContext(recipe(step, word_text), lambda _: None))
    scales = [n for n in expected.weights if n.endswith("_cache_scale")]
    assert scales and all(torch.equal(got.weights[n], expected.weights[n]) for n in scales)
    assert counter.most_layers_alive == 1


def test_the_runner_reads_a_layer_once_per_pass_over_the_set(tiny_checkpoints):
    ir, counter = lazy(load_checkpoint(str(tiny_checkpoints["llama"])))
    runner = LayerwiseRunner(ir, torch.randint(0, 50, (24, 16)), batch_size=8)
    runner.run_layer()
    assert counter.reads["layers.0.q_proj.weight"] == 1  # three batches, one read
    runner.advance()
    assert counter.reads["layers.0.q_proj.weight"] == 2
    assert counter.reads["layers.1.q_proj.weight"] == 0


def test_the_memory_estimate_grows_with_the_calibration_set(tiny_checkpoints):
    arch = load_checkpoint(str(tiny_checkpoints["llama"])).arch
    for method in ("gptq", "awq", "kv_cache"):
        small = calibration_memory_bytes(arch, 16, 64, method)
        large = calibration_memory_bytes(arch, 64, 64, method)
        assert large - small >= 2 * 48 * 64 * arch.hidden_size * 4  # the carried states
    with pytest.raises(ValueError, match="unknown method"):
        calibration_memory_bytes(arch, 16, 64, "rtn")
