"""Sequential calibration: layer by layer, each layer's weights read once per pass over the
calibration set and released before the next layer's are read."""

from __future__ import annotations

import re
import weakref
from collections import Counter

import pytest
import torch

from llmopt.compiler import calibration
from llmopt.compiler.calibration import LayerwiseRunner, matmul_dtype, symmetric_gram
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext, apply_passes
from llmopt.compiler.recipe import CalibrationConfig, Recipe

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


def bf16_copy(path, tmp_path):
    """The checkpoint at `path` with every tensor stored in bfloat16."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "bf16"
    shutil.copytree(path, copy)
    for file in copy.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(file),
                  metadata={"format": "pt"})
    return copy


def test_auto_precision_follows_the_checkpoints_linears(tiny_checkpoints, tmp_path,
                                                       monkeypatch):
    monkeypatch.setattr(calibration, "fast_bfloat16", lambda: True)
    auto, exact = CalibrationConfig(), CalibrationConfig(precision="float32")
    float_ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    bf16_ir = load_checkpoint(str(bf16_copy(tiny_checkpoints["llama"], tmp_path)))
    assert matmul_dtype(float_ir, auto) == torch.float32
    assert matmul_dtype(bf16_ir, auto) == torch.bfloat16
    assert matmul_dtype(bf16_ir, exact) == torch.float32
    rewritten = bf16_ir.copy()  # a pass's float32 result is no longer the checkpoint's
    rewritten.weights["layers.0.q_proj.weight"] = rewritten.weights["layers.0.q_proj.weight"] * 2
    assert matmul_dtype(rewritten, auto) == torch.float32


def test_auto_precision_is_float32_where_bfloat16_is_emulated(tiny_checkpoints, tmp_path,
                                                              monkeypatch):
    monkeypatch.setattr(calibration, "fast_bfloat16", lambda: False)
    bf16_ir = load_checkpoint(str(bf16_copy(tiny_checkpoints["llama"], tmp_path)))
    assert matmul_dtype(bf16_ir, CalibrationConfig()) == torch.float32
    assert matmul_dtype(bf16_ir, CalibrationConfig(precision="bfloat16")) == torch.bfloat16


def test_bfloat16_linears_keep_float32_states_close_to_float32(tiny_checkpoints, tmp_path):
    ir = load_checkpoint(str(bf16_copy(tiny_checkpoints["llama"], tmp_path)))
    windows = torch.randint(0, ir.arch.vocab_size, (4, 32))
    states = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = LayerwiseRunner(ir, windows, precision=dtype)
        for _ in range(ir.arch.num_layers):
            runner.advance()
        states[dtype] = torch.cat(runner.hidden)
    assert states[torch.bfloat16].dtype == torch.float32
    error = (states[torch.bfloat16] - states[torch.float32]).norm() / states[torch.float32].norm()
    # Inputs round at 2⁻⁹ per linear; random tiny layers amplify it over the depth.
    assert 0 < error < 5e-2


@pytest.mark.parametrize("columns", [5, 300, 4100])
def test_symmetric_gram_is_the_full_product(columns):
    x = torch.randn(64, columns)
    gram = symmetric_gram(x, block=256)
    torch.testing.assert_close(gram, x.T @ x, rtol=1e-5, atol=1e-4)
