"""Code-book 4-bit projections (NF4, FP4) on the native step: one 16-value lookup per code.

The native step rounds the code book to 127ths of each block's absmax and quantizes the
activations to int8 per block, as it does for integer codes; a projection is checked
against that arithmetic exactly (integer dots, float sums) and against ONNX Runtime's
MatMulBnb4 (float) within the rounding it adds; a compiled NF4 artifact runs natively.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_native_step import check_linear

from llmopt.compiler.nf4 import FP4_CODE, NF4_CODE, codebook_quantize, pack_bnb
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.executors.native import NativeLaneExecutor
from llmopt.runtime.native.codebook import lookup_table
from llmopt.runtime.native.library import default_knobs, kernels
from llmopt.runtime.native.plan import QuantizedMatrix, Tensor
from llmopt.runtime.native.weights import codebook_matrix

lib = kernels()
pytestmark = pytest.mark.skipif(lib is None or not lib.llmopt_native_supported(),
                                reason="no native kernels in this install, or no AVX-512 VNNI")
KNOBS = default_knobs() if lib is not None else None


def native_arithmetic(x: np.ndarray, codes: np.ndarray, absmax: np.ndarray,
                      code: np.ndarray, block: int) -> np.ndarray:
    """What the kernels compute: int8 activations per block (absmax / 127, half to even),
    the code book at 127ths, exact integer dots, float scales per block."""
    rows, k = x.shape
    table = lookup_table(tuple(code.tolist())).astype(np.int64) - 128
    blocks = x.reshape(rows, -1, block)
    scale = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale == 0, 1, scale), 0)
    q = np.rint(blocks * inverse[..., None].astype(np.float32)).astype(np.int64)
    w = table[codes].reshape(codes.shape[0], -1, block)  # [n, B, block]
    dots = np.einsum("rbi,nbi->rnb", q, w).astype(np.float64)
    w_scale = (absmax / np.float32(127)).astype(np.float32)  # [n, B]
    return (dots * (scale[:, None, :].astype(np.float64) * w_scale[None])).sum(-1)


@pytest.mark.parametrize(("code", "block", "k"), [(NF4_CODE, 64, 192), (FP4_CODE, 32, 160),
                                                  (NF4_CODE, 128, 256)])
def test_a_codebook_projection(code, block, k):
    rng = np.random.default_rng(block)
    n, rows = 40, 19
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
    q = codebook_quantize(w, block, code)
    packed, absmax = pack_bnb(q.codes).numpy().reshape(-1), q.scales.numpy().reshape(-1)
    spec = QuantizedMatrix(Tensor("uint8", packed.shape), Tensor("float32", absmax.shape),
                           None, 4, block, n, k, codebook=tuple(code.tolist()))
    arrays, matrix = codebook_matrix(spec, packed, absmax, np.ascontiguousarray)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    expected = native_arithmetic(x, q.codes.numpy(), q.scales.numpy(), code.numpy(), block)
    got = check_linear(matrix, x, expected, rows=(0, 7, 18))
    graph_out = _matmul_bnb4(x, packed, absmax, n, k, block, code)
    error = np.abs(got - graph_out).max() / np.abs(graph_out).max()
    assert error < 0.03  # int8 activations and the code book at 127ths: ~1 % of the range


def _matmul_bnb4(x, packed, absmax, n, k, block, code) -> np.ndarray:
    quant_type = 1 if torch.equal(code, NF4_CODE) else 0
    node = helper.make_node("MatMulBnb4", ["x", "B", "absmax"], ["y"], domain="com.microsoft",
                            K=k, N=n, block_size=block, quant_type=quant_type)
    graph = helper.make_graph(
        [node], "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.shape[0], n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(absmax, "absmax")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def nf4_artifact(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nf4") / "llama-nf4"
    passes = [{"rtn": {"format": "nf4", "group_size": 32, "double_quant": True,
                       "include_lm_head": True}}]
    recipe = Recipe(model=str(tiny_checkpoints["llama"]), passes=passes,
                    target={"nbits_accuracy_level": 4}, quality={"measure": False},
                    runtime={"block_size": 4, "max_context": 128, "max_num_seqs": 16})
    compile_recipe(recipe, out, log=lambda _: None)
    return out


def test_an_nf4_artifact_runs_natively_near_onnx_runtime(nf4_artifact):
    native, reference = (LLM(nf4_artifact, kernels=k, speculative=False)
                         for k in ("native", "onnxruntime"))
    assert isinstance(native.engine.executor, NativeLaneExecutor)
    plan = native.manifest.graphs["target"].native
    assert plan["layers"][0]["qkv"]["codebook"] == NF4_CODE.tolist()
    tokens = list(range(3, 90))
    got, expected = native.score(tokens), reference.score(tokens)
    # ONNX Runtime's MatMulBnb4 multiplies float activations: the gap is the int8-activation
    # noise that int4 codes show at accuracy level 4 against level 0 on these random weights
    # (log-probs max ~0.45, mean ~0.07), plus the code book's rounding to 127ths.
    assert np.abs(got - expected).max() < 0.6 and np.abs(got - expected).mean() < 0.15


def test_batching_changes_no_nf4_output(nf4_artifact):
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, 250, 3 + 4 * i)] for i in range(6)]
    llm = LLM(nf4_artifact, kernels="native", speculative=False)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == alone
