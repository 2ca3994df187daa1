"""Lowered ONNX graphs, driven through the paged-KV contract, match ReferenceModel."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.lower import LoweringOptions, lower_to_onnx
from llmopt.compiler.onnx_graph import MS_DOMAIN, save_with_external_data
from llmopt.compiler.reference import ReferenceModel, greedy_generate
from llmopt.runtime import contract as C

OPERATOR_SETS = ("onnxruntime", "standard")
ATOL = 1e-4


def prompt_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator).tolist()


def compile_graph(ir: ModelIR, directory: Path, **options) -> tuple[onnx.ModelProto, str]:
    """Lower, save with external data, and return (model, path of the .onnx file)."""
    model = lower_to_onnx(ir, LoweringOptions(**options))
    directory.mkdir(parents=True, exist_ok=True)
    save_with_external_data(model, directory / "model.onnx")
    return model, str(directory / "model.onnx")


def open_session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def reference_logits(ir: ModelIR, tokens: list[int]) -> np.ndarray:
    return ReferenceModel(ir).forward(torch.tensor([tokens]))[0].numpy()


@pytest.fixture(scope="module", params=OPERATOR_SETS)
def operator_set(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def lowered(ir, operator_set, tmp_path_factory) -> tuple[onnx.ModelProto, str]:
    directory = tmp_path_factory.mktemp(f"{ir.arch.family}_{operator_set}")
    return compile_graph(ir, directory, operator_set=operator_set)


@pytest.fixture(scope="module")
def session(lowered) -> ort.InferenceSession:
    return open_session(lowered[1])


def test_chunked_prefill_then_greedy_decode(ir, session, paged_driver):
    """Prefill in two chunks (splitting a block), then 32 greedy decode steps."""
    driver, prompt = paged_driver(session, ir.arch), prompt_ids(37, seed=1)
    first = driver.step({0: prompt[:19]})[0]
    second = driver.step({0: prompt[19:]})[0]
    assert driver.block_tables[0] != sorted(driver.block_tables[0])  # really non-contiguous
    np.testing.assert_allclose(
        np.concatenate([first, second]), reference_logits(ir, prompt), rtol=0, atol=ATOL
    )

    tokens, decode_logits = [int(second[-1].argmax())], []
    for _ in range(31):
        decode_logits.append(driver.step({0: tokens[-1:]})[0])
        tokens.append(int(decode_logits[-1][-1].argmax()))
    assert tokens == greedy_generate(ReferenceModel(ir), prompt, 32)
    expected = reference_logits(ir, prompt + tokens[:-1])[len(prompt) :]
    np.testing.assert_allclose(np.concatenate(decode_logits), expected, rtol=0, atol=ATOL)


def test_batched_steps_with_right_padding(ir, session, paged_driver):
    """Sequences with different context and query lengths share each step."""
    driver = paged_driver(session, ir.arch)
    a, b, c = prompt_ids(17, seed=2), prompt_ids(6, seed=3), prompt_ids(5, seed=4)
    steps = [
        {0: a, 1: b},  # prefill: both from context 0, b padded
        # contexts 17, 6 and 0; b's and c's tables padded with the null block
        {0: prompt_ids(3, seed=5), 1: prompt_ids(9, seed=6), 2: c},
        {0: [7], 1: [9], 2: [11]},  # decode, a and b past the sliding window
    ]
    outputs = [driver.step(queries) for queries in steps]
    for seq in (0, 1, 2):
        tokens = [t for queries in steps for t in queries.get(seq, [])]
        actual = np.concatenate([out[seq] for out in outputs if seq in out])
        np.testing.assert_allclose(actual, reference_logits(ir, tokens), rtol=0, atol=ATOL)


def test_operator_set(lowered, operator_set):
    model, path = lowered
    ops = {(node.domain, node.op_type) for node in model.graph.node}
    if operator_set == "standard":
        assert {domain for domain, _ in ops} == {""}
        assert all(onnx.defs.has(op_type) for _, op_type in ops)
        assert [o.domain for o in model.opset_import] == [""]
        onnx.checker.check_model(path, full_check=True)
    else:
        assert (MS_DOMAIN, "SkipSimplifiedLayerNormalization") in ops
        assert (MS_DOMAIN, "RotaryEmbedding") in ops


def test_contract_io(ir, session):
    """Inputs and outputs are exactly the contract's, with the manifest's dtypes."""
    inputs = {i.name: i.type for i in session.get_inputs()}
    outputs = {o.name: o.type for o in session.get_outputs()}
    for name in (C.INPUT_IDS, C.POSITION_IDS, C.BLOCK_TABLES, C.CONTEXT_LENS, C.LOGITS_INDICES):
        assert inputs.pop(name) == "tensor(int64)"
    if any(spec.sliding_window for spec in ir.arch.layers):  # their own block table
        assert inputs.pop(C.LOCAL_BLOCK_TABLES) == "tensor(int64)"
    assert outputs.pop(C.LOGITS) == "tensor(float)"
    for i in range(ir.arch.num_layers):
        for t in ("key", "value"):
            assert inputs.pop(C.past_name(i, t)) == "tensor(float)"
            assert outputs.pop(C.new_name(i, t)) == "tensor(float)"
    assert inputs == outputs == {}


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "gemma2"])  # tied, bias, softcaps
def test_float16_weights(load_ir, arch_name, tmp_path, paged_driver):
    ir = load_ir(arch_name)
    model, path = compile_graph(ir, tmp_path, weight_dtype="float16")
    stored = {t.name: t.data_type for t in model.graph.initializer}
    assert stored["embed_tokens"] == onnx.TensorProto.FLOAT16
    assert stored["layers.0.q_proj_k_proj_v_proj"] == onnx.TensorProto.FLOAT16
    prompt = prompt_ids(20, seed=6)
    logits = paged_driver(open_session(path), ir.arch).step({0: prompt})[0]
    # Exactly the float32 model whose matrices were rounded to float16 (norms and biases
    # stay float32 in the graph).
    rounded = {name: w.half().float() if name.endswith(("_proj.weight", "embed_tokens",
                                                          "lm_head.weight")) else w
               for name, w in ir.weights.items()}
    expected = reference_logits(dataclasses.replace(ir, weights=rounded), prompt)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("operator_set", OPERATOR_SETS)
def test_float16_kv_cache_layer(load_ir, operator_set, tmp_path, paged_driver):
    """A layer with kv_dtype float16 gets float16 pool inputs and new-entry outputs."""
    base = load_ir("gemma3_text")
    ir = dataclasses.replace(base, arch=base.arch.replace_layer(1, kv_dtype="float16"))
    _, path = compile_graph(ir, tmp_path, operator_set=operator_set)
    session = open_session(path)
    types = {v.name: v.type for v in [*session.get_inputs(), *session.get_outputs()]}
    assert types[C.past_name(1, "key")] == types[C.new_name(1, "value")] == "tensor(float16)"
    assert types[C.past_name(0, "key")] == types[C.new_name(2, "value")] == "tensor(float)"

    driver = paged_driver(session, ir.arch)
    assert driver.pools[C.past_name(1, "value")].dtype == np.float16
    assert driver.pools[C.past_name(0, "value")].dtype == np.float32
    prompt = prompt_ids(25, seed=7)
    # The driver checks each step's new entries have their pool's dtype.
    first, second = driver.step({0: prompt[:14]})[0], driver.step({0: prompt[14:]})[0]
    expected = reference_logits(base, prompt)
    np.testing.assert_allclose(np.concatenate([first, second]), expected, rtol=0, atol=2e-2)
