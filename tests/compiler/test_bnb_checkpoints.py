"""bitsandbytes 4-bit checkpoints (NF4, FP4, with and without double quantization).

The tests write Linear4bit's serialized state with their own numpy writer (nearest code
by argmin, high nibble first, the packed JSON quant state) beside a float checkpoint of
the same weights dequantized independently; loading the bnb one must give the float
one's logits. Where bitsandbytes is installed its own dequantize_4bit is checked too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lower import compile_graph, open_session, prompt_ids, reference_logits

from llmopt.compiler.architectures import FAMILIES, UnsupportedModelError
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.nf4 import FP4_CODE, NF4_CODE, from_bnb
from llmopt.compiler.reference import ReferenceModel

TABLES = {"nf4": NF4_CODE.numpy(), "fp4": FP4_CODE.numpy()}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def bnb_state(w: np.ndarray, quant_type: str, block: int, double: bool
              ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """One weight's Linear4bit state (names after `<module>.`) and its dequantization."""
    table, flat = TABLES[quant_type], w.astype(np.float32).ravel()
    absmax = np.abs(flat.reshape(-1, block)).max(axis=1)
    scaled = flat.reshape(-1, block) / absmax[:, None]
    codes = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8).ravel()
    state = {"quant_type": quant_type, "blocksize": block, "dtype": "float32",
             "shape": list(w.shape)}
    tensors = {"weight": torch.from_numpy((codes[0::2] << 4) | codes[1::2])[:, None],
               "weight.quant_map": torch.from_numpy(table.copy())}
    if double:  # 8-bit absmax codes around their mean, blocks of 256, a signed linear map
        offset = np.float32(absmax.mean())
        grid = np.linspace(-1, 1, 256, dtype=np.float32)
        centred = np.pad(absmax - offset, (0, -absmax.size % 256)).reshape(-1, 256)
        nested = np.abs(centred).max(axis=1)
        q = np.abs((centred / nested[:, None])[..., None] - grid).argmin(axis=-1)
        absmax = ((grid[q] * nested[:, None]).ravel()[:absmax.size] + offset).astype(np.float32)
        tensors |= {"weight.absmax": torch.from_numpy(q.ravel()[:absmax.size].astype(np.uint8)),
                    "weight.nested_absmax": torch.from_numpy(nested),
                    "weight.nested_quant_map": torch.from_numpy(grid)}
        state |= {"nested_blocksize": 256, "nested_dtype": "float32",
                  "nested_offset": float(offset)}
    else:
        tensors["weight.absmax"] = torch.from_numpy(absmax.astype(np.float32))
    packed = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    tensors[f"weight.quant_state.bitsandbytes__{quant_type}"] = packed
    dequantized = (table[codes].reshape(-1, block) * absmax[:, None]).reshape(w.shape)
    return tensors, dequantized.astype(np.float32)


def write_bnb(source: Path, out: Path, quant_type: str, double: bool, block: int = 64
              ) -> Path:
    """`out`/bnb: the checkpoint in bitsandbytes 4-bit form; `out`/ref: the same model with
    each linear replaced by its independent dequantization, float."""
    bnb, ref = out / "bnb", out / "ref"
    for directory in (bnb, ref):
        shutil.copytree(source, directory)
    tensors = load_file(source / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            state, back = bnb_state(w.numpy(), quant_type, block, double)
            module = name.removesuffix(".weight")
            quantized |= {f"{module}.{k}": v for k, v in state.items()}
            dequantized[name] = torch.from_numpy(back)
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, bnb / "model.safetensors")
    save_file(dequantized, ref / "model.safetensors")
    config = json.loads((bnb / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double,
        "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8"}
    (bnb / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("quant_type", "double"), [("nf4", True), ("fp4", False)])
def test_each_family_loads_with_the_reference_logits(tiny_checkpoints, tmp_path, family,
                                                     quant_type, double):
    out = write_bnb(tiny_checkpoints[family], tmp_path, quant_type, double)
    bnb, ref = load_checkpoint(str(out / "bnb")), load_checkpoint(str(out / "ref"))
    assert len(bnb.quantized) == 7 * bnb.arch.num_layers
    torch.testing.assert_close(ReferenceModel(bnb).forward(IDS), ReferenceModel(ref).forward(IDS),
                               rtol=0, atol=0)


@pytest.mark.parametrize(("quant_type", "double", "block"),
                         [("nf4", False, 64), ("fp4", True, 32), ("nf4", True, 64)])
def test_weights_are_the_dequantization_exactly(tiny_checkpoints, tmp_path, quant_type,
                                                double, block):
    out = write_bnb(tiny_checkpoints["llama"], tmp_path, quant_type, double, block)
    bnb, ref = load_checkpoint(str(out / "bnb")), load_checkpoint(str(out / "ref"))
    for linear, q in bnb.quantized.items():
        assert q.group_size == block and torch.equal(q.codebook, torch.from_numpy(
            TABLES[quant_type]))
        assert torch.equal(q.dequantize(), ref.weights[f"{linear}.weight"]), linear


def test_blocks_spanning_rows_are_refused(tiny_checkpoints, tmp_path):
    out = write_bnb(tiny_checkpoints["llama"], tmp_path, "nf4", False, block=128)
    with pytest.raises(UnsupportedModelError, match="block size 128 does not divide"):
        load_checkpoint(str(out / "bnb"))


@pytest.mark.parametrize("operator_set", ["onnxruntime", "standard"])
def test_lowered_graph_computes_the_reference(tiny_checkpoints, tmp_path, paged_driver,
                                              operator_set):
    """NF4 stays code-book weights in the graph (MatMulBnb4 or Gather/Mul/MatMul)."""
    out = write_bnb(tiny_checkpoints["qwen2"], tmp_path, "nf4", True)
    ir = load_checkpoint(str(out / "bnb"))
    model, path = compile_graph(ir, tmp_path / "graph", operator_set=operator_set)
    ops = {n.op_type for n in model.graph.node}
    assert ("MatMulBnb4" in ops) == (operator_set == "onnxruntime")
    assert not ops & {"MatMulNBits", "DequantizeLinear"}
    prompt = prompt_ids(21, seed=3)
    logits = paged_driver(open_session(path), ir.arch).step({0: prompt})[0]
    np.testing.assert_allclose(logits, reference_logits(ir, prompt), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("quant_type", "double"), [("nf4", False), ("nf4", True),
                                                    ("fp4", False), ("fp4", True)])
def test_bitsandbytes_dequantizes_as_we_read(quant_type, double):
    """bitsandbytes' own dequantize_4bit (its CPU path) on a state it quantized itself."""
    functional = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    packed, state = functional.quantize_4bit(w, blocksize=64, quant_type=quant_type,
                                             compress_statistics=double)
    t = {"weight": packed} | {f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    ours = from_bnb(t, "x")
    theirs = functional.dequantize_4bit(packed, state)
    # bitsandbytes' CPU table rounds FP4's 1/192 to 0.0052; the stored map (and CUDA) do not.
    exact = (ours.codes % 8 != 1)
    assert torch.equal(ours.dequantize()[exact], theirs[exact])
    torch.testing.assert_close(ours.dequantize(), theirs, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize(("change", "message"), [
    ({"load_in_4bit": False, "load_in_8bit": True}, "8-bit (LLM.int8)"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type 'int4'"),
    ({"bnb_4bit_quant_storage": "bfloat16"}, "quant_storage 'bfloat16'"),
])
def test_unsupported_variants_are_refused_in_one_line(tiny_checkpoints, tmp_path, change,
                                                      message):
    out = write_bnb(tiny_checkpoints["llama"], tmp_path, "nf4", False)
    config_file = out / "bnb" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] |= change
    config_file.write_text(json.dumps(config))
    (out / "bnb" / "model.safetensors").write_bytes(b"")  # refused before the weights
    with pytest.raises(UnsupportedModelError, match="unsupported bitsandbytes") as error:
        load_checkpoint(str(out / "bnb"))
    assert message in str(error.value) and "\n" not in str(error.value)
