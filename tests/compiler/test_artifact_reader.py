"""A compiled artifact read back into a ModelIR, and exported to Hugging Face from there.

The weights read from the graph must be exactly the IR's after its passes (codes, scales,
zeros, float tensors), in every form the lowering writes them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from llmopt.compiler.artifact_reader import ArtifactReadError, read_artifact
from llmopt.compiler.hf_export import export_artifact, export_hf, loading_hint
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pipeline import compile_recipe, run_passes
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def recipe(model: str, rtn: dict | None, **target) -> Recipe:
    return Recipe.model_validate({
        "model": model, "passes": [{"rtn": rtn}] if rtn else [],
        "target": target, "quality": {"measure": False}, "runtime": {"max_context": 64}})


def compiled(tmp_path, model: str, rtn: dict | None, **target):
    """(artifact directory, the IR its graph was lowered from)."""
    chosen = recipe(model, rtn, **target)
    compile_recipe(chosen, tmp_path / "artifact", log=lambda _: None)
    ir, _ = run_passes(load_checkpoint(model), chosen, lambda _: None)
    return tmp_path / "artifact", ir


def assert_same_model(expected, back) -> None:
    assert back.quantized.keys() == expected.quantized.keys()
    for name, q in expected.quantized.items():
        r = back.quantized[name]
        assert (r.bits, r.group_size, r.symmetric) == (q.bits, q.group_size, q.symmetric)
        for field in ("codes", "scales", "zeros"):
            assert torch.equal(getattr(r, field), getattr(q, field)), f"{name}.{field}"
    assert back.weights.keys() == expected.weights.keys()
    for name, tensor in expected.weights.items():
        assert torch.equal(back.weights[name], tensor.float()), name
    torch.testing.assert_close(ReferenceModel(back).forward(IDS),
                               ReferenceModel(expected).forward(IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("arch", "rtn", "target"), [
    ("llama", {"bits": 4, "group_size": 32}, {"quantized_matmul": "matmul_nbits"}),
    ("llama", {"bits": 4, "group_size": 32, "symmetric": True, "include_lm_head": True},
     {"quantized_matmul": "dequantize_linear"}),
    ("qwen2", {"bits": 4, "group_size": 32, "include_lm_head": True}, {}),  # biases, untied
    ("gemma2", None, {}),  # sandwich norms, two rotary tables
])
def test_the_graph_holds_the_ir_it_was_lowered_from(tiny_checkpoints, tmp_path, arch, rtn,
                                                   target):
    artifact, ir = compiled(tmp_path, str(tiny_checkpoints[arch]), rtn, **target)
    back = read_artifact(artifact)
    assert back.arch.layers == ir.arch.layers
    assert_same_model(ir, back)


def test_export_from_the_artifact_equals_export_from_the_recipe(tiny_checkpoints, tmp_path):
    artifact, ir = compiled(tmp_path, str(tiny_checkpoints["llama"]),
                            {"bits": 4, "group_size": 32})
    export_hf(ir, tmp_path / "from_recipe")
    export_artifact(artifact, tmp_path / "from_artifact", "compressed-tensors", log=lambda _: None)
    a = load_file(tmp_path / "from_recipe" / "model.safetensors")
    b = load_file(tmp_path / "from_artifact" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for file in ("config.json", "generation_config.json", "tokenizer_config.json",
                 "tokenizer.json"):
        assert (tmp_path / "from_recipe" / file).read_text() == \
            (tmp_path / "from_artifact" / file).read_text(), file


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_float_export_loads_in_transformers_without_flags(tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    artifact, ir = compiled(tmp_path, str(tiny_checkpoints["llama"]),
                            {"bits": 4, "group_size": 32})
    out = tmp_path / "hf"
    export_artifact(artifact, out, "float", log=lambda _: None)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert loading_hint(out, "float") == (
        f"load with AutoModelForCausalLM.from_pretrained({str(out)!r}) (plain float weights)")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    torch.testing.assert_close(logits, ReferenceModel(ir).forward(IDS), rtol=0, atol=1e-4)


def test_an_asymmetric_compressed_export_prints_the_flag_it_needs(tiny_checkpoints, tmp_path):
    artifact, _ = compiled(tmp_path, str(tiny_checkpoints["llama"]),
                           {"bits": 4, "group_size": 32})
    out = tmp_path / "hf"
    export_artifact(artifact, out, "compressed-tensors", log=lambda _: None)
    assert loading_hint(out, "compressed-tensors") == (
        f"load with AutoModelForCausalLM.from_pretrained({str(out)!r}, quantization_config="
        "CompressedTensorsConfig(dequantize=True)): compressed-tensors 0.20 refuses packed "
        "asymmetric zero points otherwise; --format float writes plain float weights")


def test_an_artifact_without_its_hf_config_is_named(tiny_checkpoints, tmp_path):
    artifact, _ = compiled(tmp_path, str(tiny_checkpoints["llama"]), None)
    manifest = json.loads((artifact / "manifest.json").read_text())
    del manifest["ir"]["hf_config"]
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactReadError, match="records no Hugging Face config"):
        read_artifact(artifact)
