"""The streaming compiler: weights read on access, spilled codes, weights streamed to disk."""

from __future__ import annotations

import weakref

import numpy as np
import onnx
import torch

from llmopt.compiler.loader import load_checkpoint, map_weights
from llmopt.compiler.onnx_graph import GraphBuilder, save_with_external_data
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.quant_format import group_quantize
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.weight_store import QuantizedStore, SafetensorsSource, WeightStore


def test_overlay_copy_and_delete_leave_the_original_intact():
    store = WeightStore(overlay={"a": torch.ones(2), "b": torch.zeros(3)})
    copy = store.copy()
    copy["a"] = torch.full((2,), 7.0)
    del copy["b"]
    copy.set_lazy("c", lambda: torch.arange(4.0), (4,))
    assert torch.equal(store["a"], torch.ones(2)) and "b" in store and "c" not in store
    assert list(copy) == ["a", "c"] and torch.equal(copy["c"], torch.arange(4.0))
    assert copy.numel() == 6


def test_the_loader_reads_safetensors_lazily_and_exactly(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    from llmopt.compiler.architectures import family_for

    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    source = ir.weights.source
    assert isinstance(source, SafetensorsSource) and source.reads == 0
    assert ir.num_parameters() > 0 and source.reads == 0  # shapes only
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]),
                                              dtype=torch.float32)
    eager = map_weights(hf.state_dict(), family_for("llama"), ir.arch)
    assert list(eager) == list(ir.weights)
    for name, tensor in eager.items():
        assert torch.equal(ir.weights[name], tensor), name


def test_quantized_linears_spill_to_disk_and_read_back_equal(tmp_path):
    q = group_quantize(torch.randn(64, 96), 4, 32, symmetric=True)
    store = QuantizedStore(spill_dir=tmp_path)
    store["layers.0.q_proj"] = q
    assert list(tmp_path.iterdir())  # on disk, not in the store
    back = store["layers.0.q_proj"]
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    assert torch.equal(back.zeros, q.zeros) and (back.bits, back.group_size) == (4, 32)
    assert back.codebook is None


def test_a_code_book_linear_spills_with_its_code_book(tmp_path):
    from llmopt.compiler.nf4 import NF4_CODE, codebook_quantize

    q = codebook_quantize(torch.randn(32, 128), 64, NF4_CODE, False, None)
    store = QuantizedStore(spill_dir=tmp_path)
    store["lm_head"] = q
    assert torch.equal(store["lm_head"].dequantize(), q.dequantize())


def test_a_quantized_weight_is_dequantized_when_read_never_stored_as_float(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    q = group_quantize(ir.weights["layers.0.q_proj.weight"], 4, 32, symmetric=False)
    ir.set_quantized("layers.0.q_proj", q)
    assert not isinstance(ir.weights.overlay["layers.0.q_proj.weight"], torch.Tensor)
    assert torch.equal(ir.weights["layers.0.q_proj.weight"], q.dequantize())


def test_a_compile_holds_about_one_layer_of_source_tensors(tiny_checkpoints, tmp_path,
                                                           monkeypatch):
    """Count the source tensors alive at each read: never much more than one layer's.
    (The quality probe's own bound is tests/compiler/test_calibration.py's.)"""
    alive: list[weakref.ref] = []
    most = [0]
    read = SafetensorsSource.read

    def counting_read(self, name):
        tensor = read(self, name)
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], len(alive))
        return tensor

    monkeypatch.setattr(SafetensorsSource, "read", counting_read)
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    passes=[{"rtn": {"bits": 4, "group_size": 32}}],
                    quality={"measure": False})
    compile_recipe(recipe, tmp_path / "out", log=lambda line: None)
    per_layer = sum(1 for n in load_checkpoint(str(tiny_checkpoints["llama"])).weights
                    if n.startswith("layers.0."))
    assert 0 < most[0] <= per_layer + 2  # a layer, the embedding and the final norm


def test_streamed_weights_are_the_bytes_onnx_would_write(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"big": rng.standard_normal((64, 64)).astype(np.float32),
              "small": np.arange(8, dtype=np.int64),
              "edge": rng.standard_normal(248).astype(np.float32),  # 992 bytes: just external
              "codes": rng.integers(0, 255, (300, 7), dtype=np.uint8)}

    def build(data_file):
        g = GraphBuilder("g", 21, data_file)
        x = g.input("x", onnx.TensorProto.FLOAT, [64])
        for name, array in arrays.items():
            g.weight(name, array)
        g.output(g.op("Identity", [x]), onnx.TensorProto.FLOAT, [64])
        return g.model()

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_with_external_data(build(None), tmp_path / "a" / "m.onnx")
    save_with_external_data(build(tmp_path / "b" / "m.onnx.data"), tmp_path / "b" / "m.onnx")
    for file in ("m.onnx", "m.onnx.data"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_row_blocks_are_the_weight_a_block_at_a_time(tiny_checkpoints):
    """From the safetensors source, a quantized thunk and a plain overlay tensor alike."""
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    q = group_quantize(ir.weights["layers.0.q_proj.weight"], 4, 32, symmetric=False)
    ir.set_quantized("layers.0.q_proj", q)
    ir.weights["layers.0.k_proj.weight"] = torch.randn(ir.weights.shape("layers.0.k_proj.weight"))
    for name in ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.up_proj.weight",
                 "embed_tokens"):
        blocks = list(ir.weights.row_blocks(name, 5))
        assert [start for start, _ in blocks] == list(range(0, ir.weights.shape(name)[0], 5))
        assert all(block.shape[0] <= 5 for _, block in blocks)
        assert torch.equal(torch.cat([block for _, block in blocks]), ir.weights[name]), name
