"""Pre-quantized HF checkpoints: AutoAWQ, GPTQ v1/v2 and compressed-tensors, both ways.

Layouts are pinned three ways: known words (what AutoAWQ's and AutoGPTQ's packers produce
for known codes), independent dequantizers written after those libraries' torch paths,
and transformers itself loading our compressed-tensors export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmopt.compiler import quantized_checkpoints
from llmopt.compiler.architectures import UnsupportedModelError
from llmopt.compiler.hf_export import export_hf
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.quant_format import QuantizedLinear, group_quantize
from llmopt.compiler.quantized_checkpoints import (
    from_gptq,
    pack_int32,
    to_awq,
    to_gptq,
    unpack_int32,
)
from llmopt.compiler.reference import ReferenceModel
from llmopt.compiler.weight_store import SafetensorsSource
from llmopt.passes import rtn

IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def quantized_ir(ir: ModelIR, bits: int = 4, group_size: int = 32, symmetric: bool = False,
                 include_lm_head: bool = False) -> ModelIR:
    """RTN with float16 scales: what GPTQ and AWQ checkpoints store, so they round-trip."""
    config = rtn.Config(bits=bits, group_size=group_size, symmetric=symmetric,
                        include_lm_head=include_lm_head)
    out = rtn.run(ir, config, None).ir
    for name, q in out.quantized.items():
        out.set_quantized(name, QuantizedLinear(q.bits, q.group_size, q.codes,
                                                q.scales.half().float(), q.zeros, q.symmetric))
    return out


def assert_same_quantization(a: ModelIR, b: ModelIR) -> None:
    assert a.quantized.keys() == b.quantized.keys()
    for name, q in a.quantized.items():
        r = b.quantized[name]
        assert (r.bits, r.group_size, r.symmetric) == (q.bits, q.group_size, q.symmetric), name
        for field in ("codes", "scales", "zeros"):
            assert torch.equal(getattr(r, field), getattr(q, field)), f"{name}.{field}"
    torch.testing.assert_close(ReferenceModel(b).forward(IDS), ReferenceModel(a).forward(IDS),
                               rtol=0, atol=1e-6)


# --- layouts, pinned by known words ------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_int32_fills_low_bits_first(bits):
    values = torch.arange(1, 1 + 32 // bits)[None]
    word = sum(int(v) << (bits * i) for i, v in enumerate(values[0]))
    assert pack_int32(values, bits).item() == word - 2**32 * (word >= 2**31)
    codes = torch.randint(0, 2**bits, (5, 24))
    assert torch.equal(unpack_int32(pack_int32(codes, bits), bits, 21), codes[:, :21])


def _linear(n: int, k: int, bits: int = 4, group_size: int = 32) -> QuantizedLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    return group_quantize(w, bits, group_size, symmetric=False)


def test_awq_word_interleaves_columns_as_autoawq():
    """AutoAWQ's GEMM word j holds columns 8j + (0, 2, 4, 6, 1, 3, 5, 7), low bits first."""
    q = _linear(8, 32)
    codes = torch.arange(8, dtype=torch.uint8)[:, None].expand(8, 32)  # row n = code n
    q = QuantizedLinear(4, 32, codes.contiguous(), q.scales, q.zeros, False)
    assert to_awq(q, "x")["qweight"][0, 0].item() == 0x75316420


@pytest.mark.parametrize(("version", "word"), [(1, 0x77777777), (2, 0x88888888 - 2**32)])
def test_gptq_v1_stores_zero_minus_one(version, word):
    q = group_quantize(torch.randn(8, 64), 4, 32, symmetric=True)  # zero 8 everywhere
    assert (to_gptq(q, "x", version)["qzeros"] == word).all()


# --- independent dequantizers, after AutoAWQ's and AutoGPTQ's torch code ------------------
def autoawq_weight(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4)
    n = t["scales"].shape[1]
    reverse = torch.arange(n).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].flatten()
    w = ((t["qweight"][:, :, None] >> shifts) & 15).flatten(1)[:, reverse]
    z = ((t["qzeros"][:, :, None] >> shifts) & 15).flatten(1)[:, reverse]
    scales = t["scales"].float().repeat_interleave(group_size, 0)
    return ((w - z.repeat_interleave(group_size, 0)) * scales).T


def autogptq_weight(t: dict[str, torch.Tensor], bits: int, version: int) -> torch.Tensor:
    shifts, mask = torch.arange(0, 32, bits), 2**bits - 1
    z = ((t["qzeros"][:, :, None] >> shifts) & mask).flatten(1) + (version == 1)
    w = ((t["qweight"][:, None, :] >> shifts[None, :, None]) & mask).flatten(0, 1)
    g = t["g_idx"].long()
    return ((w - z[g]) * t["scales"].float()[g]).T


def test_autoawq_reads_our_awq_as_we_do():
    q = _linear(24, 64)
    t = to_awq(q, "x")
    expected = QuantizedLinear(4, 32, q.codes, q.scales.half().float(), q.zeros, False)
    torch.testing.assert_close(autoawq_weight(t, 32), expected.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
def test_autogptq_reads_our_gptq_as_we_do(bits, version):
    q = _linear(16, 64, bits)
    q = QuantizedLinear(bits, 32, q.codes, q.scales, q.zeros.clamp(min=1), False)  # v1: zero≥1
    t = to_gptq(q, "x", version)
    back = from_gptq(t, bits, 32, version, "x")
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)
    torch.testing.assert_close(autogptq_weight(t, bits, version), back.dequantize(),
                               rtol=0, atol=0)


def test_per_channel_gptq_becomes_repeated_groups():
    """group_size -1 (one scale a row) reads as 128-wide groups sharing it: MatMulNBits
    blocks are powers of two, and 256 inputs are two such blocks."""
    q = group_quantize(torch.randn(8, 256), 4, 256, symmetric=False)
    back = from_gptq(to_gptq(q, "x", 2), 4, -1, 2, "x")
    assert back.group_size == 128 and back.scales.shape == (8, 2)
    torch.testing.assert_close(back.dequantize(), QuantizedLinear(
        4, 256, q.codes, q.scales.half().float(), q.zeros, False).dequantize(), rtol=0, atol=0)


# --- whole checkpoints through the loader ------------------------------------------------
@pytest.mark.parametrize(("fmt", "bits", "symmetric"), [
    ("awq", 4, False),
    ("gptq", 4, True),  # v1
    ("gptq", 8, False),
    ("gptq_v2", 4, False),
    ("compressed-tensors", 4, False),
    ("compressed-tensors", 8, True),
])
def test_checkpoint_round_trip(load_ir, tmp_path, fmt, bits, symmetric):
    ir = quantized_ir(load_ir("llama"), bits, symmetric=symmetric)
    if fmt == "gptq":  # v1 cannot store a zero point of 0
        for name, q in ir.quantized.items():
            ir.set_quantized(name, QuantizedLinear(q.bits, q.group_size, q.codes, q.scales,
                                                   q.zeros.clamp(min=1), q.symmetric))
    export_hf(ir, tmp_path / "out", fmt)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == fmt.partition("_")[0]
    back = load_checkpoint(str(tmp_path / "out"))
    assert_same_quantization(ir, back)
    assert back.tokenizer_files == ir.tokenizer_files and back.chat_template == ir.chat_template


@pytest.mark.parametrize("arch", ["gemma2", "qwen2"])  # norm offset; qkv bias and no tying
def test_other_architectures_round_trip(load_ir, tmp_path, arch):
    ir = quantized_ir(load_ir(arch), include_lm_head=True)
    export_hf(ir, tmp_path / "out")
    assert_same_quantization(ir, load_checkpoint(str(tmp_path / "out")))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize(("bits", "symmetric", "lm_head"), [(4, True, True), (4, False, False),
                                                            (8, True, False)])
def test_transformers_loads_compressed_tensors_export(load_ir, tmp_path, bits, symmetric,
                                                      lm_head):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ir = rtn.run(load_ir("llama"), rtn.Config(bits=bits, group_size=32, symmetric=symmetric,
                                              include_lm_head=lm_head), None).ir
    export_hf(ir, tmp_path / "out")
    # compressed-tensors 0.20 builds asymmetric modules on the meta device with unpacked zero
    # points, so transformers' default load refuses the (correctly) packed ones
    # (llm-compressor issue #1618); dequantizing at load reads them through the compressor.
    options = {} if symmetric else {"quantization_config": CompressedTensorsConfig(
        dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                 **options).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    torch.testing.assert_close(logits, ReferenceModel(ir).forward(IDS), rtol=0, atol=1e-4)


# --- what is refused, and how ------------------------------------------------------------
def _rewrite(directory: Path, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_act_order_groups_are_refused_naming_the_layer(load_ir, tmp_path):
    export_hf(quantized_ir(load_ir("llama")), tmp_path / "out", "gptq_v2")
    name = "model.layers.1.mlp.down_proj"
    _rewrite(tmp_path / "out", lambda t: t.update(
        {f"{name}.g_idx": t[f"{name}.g_idx"].flip(0).contiguous()}))
    with pytest.raises(UnsupportedModelError, match=rf"{name}: GPTQ act-order"):
        load_checkpoint(str(tmp_path / "out"))


def test_gptq_v1_zero_of_zero_is_refused(load_ir, tmp_path):
    ir = quantized_ir(load_ir("llama"))
    q = ir.quantized["layers.0.q_proj"]
    ir.set_quantized("layers.0.q_proj", QuantizedLinear(4, 32, q.codes, q.scales,
                                                        torch.zeros_like(q.zeros), False))
    with pytest.raises(ValueError, match="q_proj: GPTQ v1 cannot store a zero point of 0"):
        export_hf(ir, tmp_path / "out", "gptq")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes checkpoint: no load_in_4bit"),
    ({"version": "gemv"}, "version 'gemv'"),
    ({"bits": 8}, "bits 8"),
])
def test_unsupported_quantization_configs_are_named(load_ir, tmp_path, change, message):
    export_hf(quantized_ir(load_ir("llama")), tmp_path / "out", "awq")
    path = tmp_path / "out" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] |= change
    path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        load_checkpoint(str(tmp_path / "out"))


def test_partial_last_group_is_refused(load_ir, tmp_path):
    ir = rtn.run(load_ir("llama"), rtn.Config(group_size=128), None).ir  # hidden 64 < 128
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        export_hf(ir, tmp_path / "out")


def test_export_hf_command(tiny_checkpoints, tmp_path):
    from click.testing import CliRunner

    from llmopt.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {tiny_checkpoints['llama']}\n"
                      "passes:\n  - rtn: {bits: 4, group_size: 32, symmetric: true, "
                      "include_lm_head: false}\n")
    result = CliRunner().invoke(main, ["export-hf", str(recipe), "-o", str(tmp_path / "out"),
                                       "--format", "gptq"])
    assert result.exit_code == 0, result.output
    assert len(load_checkpoint(str(tmp_path / "out")).quantized) == 21
    bad = CliRunner().invoke(main, ["export-hf", str(recipe), "-o", str(tmp_path / "o2"),
                                    "--set", "passes.0.rtn.group_size=128"])
    assert bad.exit_code == 1 and "group_size 128 does not divide" in bad.output
    unknown = CliRunner().invoke(main, ["export-hf", str(recipe), "-o", str(tmp_path / "o3"),
                                        "--format", "gguf"])
    assert unknown.exit_code == 1 and "unknown export format 'gguf'" in unknown.output


def test_exported_metadata_is_what_serving_tools_read(load_ir, tmp_path):
    """`architectures` names the class (vLLM dispatches on it), no build-machine path
    leaks, and the files are readable by others."""
    import json

    from llmopt.compiler.hf_export import export_hf

    ir = load_ir("llama").copy()  # as a GGUF source reads: no class, the build's path
    ir.annotations["hf_config"] = {**ir.annotations["hf_config"], "architectures": None,
                                   "_name_or_path": "/home/build/venv/lib/model"}
    out = tmp_path / "out"
    export_hf(ir, out, "compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "_name_or_path" not in config
    assert all(file.stat().st_mode & 0o777 == 0o644 for file in out.iterdir())


def test_an_export_larger_than_a_shard_is_sharded_with_an_index(tiny_checkpoints, tmp_path,
                                                                monkeypatch):
    """Shards of about SHARD_BYTES and transformers' index: the same tensors as one file."""
    from llmopt.compiler import hf_export

    ir = rtn.run(load_checkpoint(str(tiny_checkpoints["llama"])),
                 rtn.Config(bits=4, group_size=32), None).ir
    hf_export.export_hf(ir, tmp_path / "one", "compressed-tensors")
    monkeypatch.setattr(hf_export, "SHARD_BYTES", 40_000)
    hf_export.export_hf(ir, tmp_path / "many", "compressed-tensors")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    last = f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert len(shards) > 2 and shards[-1] == last
    whole = load_file(tmp_path / "one" / "model.safetensors")
    parts = {k: v for shard in shards for k, v in load_file(tmp_path / "many" / shard).items()}
    assert parts.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in whole.values())
    assert not list((tmp_path / "many").glob(".shard-*"))
    sharded, single = (load_checkpoint(str(tmp_path / d)) for d in ("many", "one"))
    assert sharded.arch == single.arch and sharded.quantized.keys() == single.quantized.keys()


def test_a_loaded_checkpoint_leaves_its_codes_in_the_files(load_ir, tmp_path, monkeypatch):
    """Nothing but headers stays in memory: each module is read once at load (its header,
    and any refusal) and again on each access, one at a time."""
    ir = quantized_ir(load_ir("llama"), include_lm_head=True)
    export_hf(ir, tmp_path / "out", "gptq_v2")
    reads: list[str] = []
    real = quantized_checkpoints._read_module
    monkeypatch.setattr(quantized_checkpoints, "_read_module",
                        lambda read, module, stored: reads.append(module) or real(read, module,
                                                                                 stored))
    back = load_checkpoint(str(tmp_path / "out"))
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(ir.quantized)
    assert not any(isinstance(entry, QuantizedLinear) for entry in back.quantized.entries.values())
    assert isinstance(back.weights.source, SafetensorsSource) and back.weights.source.reads == 0
    reads.clear()
    assert_same_quantization(ir, back)
    assert len(reads) >= len(ir.quantized)  # read again from the files, on access


def test_a_weight_pass_keeps_the_checkpoints_codes_and_quantizes_the_rest(load_ir, tmp_path):
    """`rtn` on a GPTQ checkpoint quantizes only what came float (the LM head, at its
    default 8 bits); quantizing the codes again would only lose."""
    ir = quantized_ir(load_ir("llama"))
    export_hf(ir, tmp_path / "out", "gptq_v2")
    back = load_checkpoint(str(tmp_path / "out"))
    after = rtn.run(back, rtn.Config(bits=4, symmetric=True), None).ir
    assert set(after.quantized) == set(ir.quantized) | {"lm_head"}
    assert after.quantized.scheme("lm_head")[0] == 8
    for name in ir.quantized:
        assert torch.equal(after.quantized[name].codes, ir.quantized[name].codes)
