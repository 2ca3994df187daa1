"""compiler/native_plan.py: the native step's typed plan of a lowered lanes graph, and its
manifest form (runtime/native/plan.py), on tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.lower import lower
from llmopt.compiler.onnx_graph import save_with_external_data
from llmopt.compiler.pass_manager import PassContext, apply_passes
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.native.plan import (
    EmbeddingRows,
    NativePlan,
    QuantizedMatrix,
    Tensor,
    Unsupported,
    read_plan,
    rotary_tables,
)

A8 = {"nbits_accuracy_level": 4}
RTN = {"rtn": {"bits": 4, "group_size": 32, "symmetric": True, "include_lm_head": True,
               "lm_head_bits": 8}}
KV8 = {"kv_cache": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel"}}
CASES = {  # name -> (architecture, passes, target options)
    "llama": ("llama", [RTN], A8),
    "llama-kv8": ("llama", [KV8, RTN], A8),
    "qwen3": ("qwen3", [RTN], A8),
    "float-activations": ("llama", [RTN], {}),
    "blocks": ("llama", [RTN], {**A8, "kv_layout": "blocks"}),
}


@pytest.fixture(scope="module")
def compiled(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native_plan")
    out = {}
    for name, (arch, passes, target) in CASES.items():
        recipe = Recipe(model=str(tiny_checkpoints[arch]), passes=passes, target=target,
                        quality={"measure": False},
                        calibration={"text": str(word_text), "samples": 4, "seq_len": 64},
                        runtime={"block_size": 4, "max_context": 64, "max_num_seqs": 4})
        out[name] = root / name
        compile_recipe(recipe, out[name], log=lambda _: None)
    return out


def _native(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())["graphs"]["target"]["native"]


@pytest.mark.parametrize("name", ["llama", "llama-kv8", "qwen3"])
def test_the_manifest_holds_the_typed_plan_key_for_key(name, compiled):
    """The manifest's section reads back as a NativePlan whose manifest form is the
    section itself, key for key and in order (the JSON the writer wrote, byte for byte)."""
    section = _native(compiled[name])
    plan = read_plan(section)
    assert isinstance(plan, NativePlan)
    assert json.dumps(plan.to_manifest()) == json.dumps(section)


@pytest.mark.parametrize("name", ["llama", "llama-kv8", "qwen3"])
def test_the_plan_describes_the_model_and_where_its_weights_lie(name, compiled):
    """Shapes are the model's; every external tensor lies inside the weights file with the
    bytes its dtype and shape take; lanes and head norms are the layers' own."""
    artifact = compiled[name]
    manifest = load_manifest(artifact)
    graph, model = manifest.graphs["target"], manifest.model
    plan = read_plan(graph.native)
    assert isinstance(plan, NativePlan)
    assert (plan.hidden, plan.vocab, len(plan.layers)) == (
        model.hidden_size, model.vocab_size, model.num_layers)
    assert plan.heads % plan.kv_heads == 0 and plan.head.n == plan.vocab
    size = (artifact / graph.data_file).stat().st_size
    for tensor in _tensors(plan):
        if tensor.values is None:
            assert tensor.length == np.dtype(tensor.dtype).itemsize * int(np.prod(tensor.shape))
            assert tensor.offset >= 0 and tensor.offset + tensor.length <= size
        else:
            assert len(tensor.values) == int(np.prod(tensor.shape))
    layer = plan.layers[0]
    assert (layer.kv is not None and layer.kv.bits) == (8 if name == "llama-kv8" else False)
    assert (layer.q_norm is not None) == (name == "qwen3")
    assert layer.qkv.n == (plan.heads + 2 * plan.kv_heads) * plan.head_dim
    assert isinstance(plan.embed, Tensor | EmbeddingRows)


def _tensors(plan: NativePlan) -> list[Tensor]:
    """Every tensor a plan names."""
    def matrix(m: QuantizedMatrix) -> list[Tensor | None]:
        return [m.codes, m.scales, m.zeros, m.offsets, m.bias]

    found: list[Tensor | None] = [plan.rope_cos, plan.rope_sin, plan.final_norm,
                                  *matrix(plan.head)]
    found += ([plan.embed] if isinstance(plan.embed, Tensor)
              else [plan.embed.codes, plan.embed.scales, plan.embed.zeros])
    for layer in plan.layers:
        found += [layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm]
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            found += matrix(m)
        if layer.kv is not None:
            found += [layer.kv.key_scale, layer.kv.value_scale, layer.kv.rotation]
    return [t for t in found if t is not None]


@pytest.mark.parametrize("name,reason", [
    ("float-activations", "float activations"), ("blocks", "not a lanes graph")])
def test_a_graph_the_native_step_cannot_run_gets_a_reason(name, reason, compiled):
    """Float activations or gathered-blocks KV: Unsupported, its reason in the manifest;
    a lanes graph's rotary tables beside it (what streaming turns kept keys with), the
    tables the graph holds."""
    section = _native(compiled[name])
    plan = read_plan(section)
    assert isinstance(plan, Unsupported) and reason in plan.reason
    if name == "blocks":  # no lanes to evict from
        assert set(section) == {"unsupported"} and rotary_tables(plan) is None
        return
    assert set(section) == {"unsupported", "rope"} and plan.to_manifest() == section
    graph = load_manifest(compiled[name]).graphs["target"]
    model = onnx.load(compiled[name] / graph.file)
    want = {t.name: numpy_helper.to_array(t, base_dir=str(compiled[name]))
            for t in model.graph.initializer if t.name.startswith("rope.")}
    tables = rotary_tables(plan)
    assert tables is not None
    for table, side in zip(tables, ("cos", "sin"), strict=True):
        if table.values is not None:
            got = np.asarray(table.values, np.float32)
        else:
            data = np.fromfile(compiled[name] / str(graph.data_file), np.uint8)
            got = data[table.offset:table.offset + table.length].view(np.float32)
        np.testing.assert_array_equal(got.reshape(table.shape), want[f"rope.global.{side}"])


def test_the_lowering_records_the_typed_plan(tiny_checkpoints, tmp_path, compiled):
    """The lowering records the plan as it emits the graph; saved, it resolves to the typed
    plan the manifest holds (the writer's call)."""
    arch, passes, target = CASES["llama"]
    recipe = Recipe(model=str(tiny_checkpoints[arch]), passes=passes, target=target,
                    quality={"measure": False},
                    runtime={"block_size": 4, "max_context": 64, "max_num_seqs": 4})
    ir, _ = apply_passes(load_checkpoint(recipe.model), recipe.passes,
                         PassContext(recipe, lambda _: None))
    lowered = lower(ir, recipe)
    save_with_external_data(lowered.model, tmp_path / "target.onnx")
    plan = lowered.native.resolve(lowered.model)
    assert isinstance(plan, NativePlan)
    assert plan.to_manifest() == _native(compiled["llama"])


@pytest.mark.parametrize("arch,reason", [
    ("gemma2", "scaled embeddings"), ("gemma3_text", "scaled embeddings"), ("llama", None),
    ("mistral", None), ("qwen2", None), ("qwen3", None)])
def test_each_family_gets_a_plan_or_the_reason_it_has_none(arch, reason, tiny_checkpoints,
                                                           tmp_path):
    """Llama-style families run natively; Gemma's scaled embeddings, GELU and norms after
    attention do not (the first the lowering met is named)."""
    recipe = Recipe(model=str(tiny_checkpoints[arch]), passes=[RTN], target=A8,
                    quality={"measure": False},
                    runtime={"block_size": 4, "max_context": 64, "max_num_seqs": 4})
    compile_recipe(recipe, tmp_path / "out", log=lambda _: None)
    plan = read_plan(_native(tmp_path / "out"))
    if reason is None:
        assert isinstance(plan, NativePlan)
    else:
        assert isinstance(plan, Unsupported) and reason in plan.reason
