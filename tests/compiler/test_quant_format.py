"""Group quantization numerics and the MatMulNBits layout that consumes them."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from llmopt.compiler.quant_format import (
    QuantizedLinear,
    concat_outputs,
    group_quantize,
    pack_matmul_nbits,
)


def weight(n: int = 24, k: int = 72, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_error_is_at_most_half_a_step(bits, symmetric):
    w = weight()
    q = group_quantize(w, bits, 32, symmetric)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < 2**bits
    assert q.scales.shape == (24, 3)  # 72 = 32 + 32 + a short group of 8
    step = q.scales.abs().repeat_interleave(32, dim=1)[:, :72]
    inside = (q.codes > 0) & (q.codes < 2**bits - 1)  # clipped codes may err more
    assert ((w - q.dequantize()).abs()[inside] <= step[inside] / 2 + 1e-6).all()
    if symmetric:
        assert (q.zeros == 2 ** (bits - 1)).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_extreme_is_exact_and_takes_code_zero(bits):
    """Each group's largest-magnitude weight, whatever its sign, takes code 0 (-2^(bits-1))
    and comes back exactly: the scale is negative when that weight is positive."""
    w = weight()
    w[0, :32] = w[0, :32].abs()  # a group whose extreme is positive
    w[1, :32] = -w[1, :32].abs()  # and one whose extreme is negative
    q = group_quantize(w, bits, 32, symmetric=True)
    groups = w[:, :64].reshape(24, 2, 32)
    at = groups.abs().argmax(-1, keepdim=True)
    extreme = groups.gather(-1, at).squeeze(-1)
    codes = q.codes[:, :64].reshape(24, 2, 32).gather(-1, at).squeeze(-1)
    assert (codes == 0).all()
    assert torch.allclose(q.dequantize()[:, :64].reshape(24, 2, 32).gather(-1, at).squeeze(-1),
                          extreme)
    assert q.scales[0, 0] < 0 < q.scales[1, 0]


def test_short_last_group_uses_only_its_own_columns():
    w = weight()
    w[:, 64:] *= 0.01  # the last group's range is tiny: its scale must be too
    q = group_quantize(w, 4, 32, symmetric=False)
    alone = group_quantize(w[:, 64:], 4, 32, symmetric=False)
    torch.testing.assert_close(q.scales[:, 2], alone.scales[:, 0])
    torch.testing.assert_close(q.dequantize()[:, 64:], alone.dequantize())


def test_concat_needs_matching_groups():
    a, b = group_quantize(weight(), 4, 32, False), group_quantize(weight(seed=1), 4, 64, False)
    with pytest.raises(ValueError, match="same bits"):
        concat_outputs([a, b])
    both = concat_outputs([a, group_quantize(weight(seed=1), 4, 32, False)])
    assert both.shape == (48, 72)


def run_matmul_nbits(q: QuantizedLinear, x: np.ndarray) -> np.ndarray:
    packed = pack_matmul_nbits(q)
    n, k = q.shape
    node = helper.make_node("MatMulNBits", ["x", *packed], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=q.bits, block_size=q.group_size)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, name) for name, v in packed.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize(("bits", "group", "k", "symmetric", "float_zero"), [
    (4, 32, 72, False, False),
    (4, 32, 72, True, False),
    (4, 128, 576, False, False),  # SmolLM2's width: 4.5 groups of 128
    (4, 64, 576, False, True),  # GGUF Q4_1-style fractional zero points
    (8, 32, 72, False, False),
    (8, 64, 576, True, False),
])
def test_matmul_nbits_computes_the_dequantized_product(bits, group, k, symmetric, float_zero):
    q = group_quantize(weight(40, k), bits, group, symmetric)
    if float_zero:
        q = QuantizedLinear(q.bits, q.group_size, q.codes, q.scales, q.zeros + 0.37, False)
        assert "zero_points" in pack_matmul_nbits(q)
        assert pack_matmul_nbits(q)["zero_points"].dtype == np.float32
    x = np.random.default_rng(0).standard_normal((5, k)).astype(np.float32)
    expected = x @ q.dequantize().numpy().T
    np.testing.assert_allclose(run_matmul_nbits(q, x), expected, rtol=1e-4, atol=1e-4)


def test_fractional_zero_points_split_into_symmetric_codes_and_group_offsets():
    from llmopt.compiler.quant_format import group_sum_matrix, split_fractional_zeros

    q = group_quantize(weight(16, 72), 4, 32, symmetric=False)
    q = QuantizedLinear(4, 32, q.codes, q.scales, q.zeros + 0.37, False)  # Q4_1-like
    symmetric, offset = split_fractional_zeros(q)
    assert symmetric.symmetric and offset.shape == (3, 16)
    x = np.random.default_rng(1).standard_normal((5, 72)).astype(np.float32)
    split = x @ symmetric.dequantize().numpy().T + (x @ group_sum_matrix(72, 32)) @ offset
    np.testing.assert_allclose(split, x @ q.dequantize().numpy().T, rtol=1e-5, atol=1e-4)


# --- the inverses: a compiled graph's integer weights read back ---------------------------
@pytest.mark.parametrize(("bits", "group", "k", "symmetric", "float_zero"), [
    (4, 32, 72, False, False),  # a short last group, packed uint8 zero points
    (4, 32, 72, True, False),  # no zero points at all
    (4, 128, 576, False, True),  # float zero points
    (8, 32, 72, False, False),
    (8, 64, 576, True, False),
])
def test_matmul_nbits_unpacks_to_the_same_linear(bits, group, k, symmetric, float_zero):
    from llmopt.compiler.quant_format import unpack_matmul_nbits

    q = group_quantize(weight(40, k), bits, group, symmetric)
    if float_zero:
        q = QuantizedLinear(q.bits, q.group_size, q.codes, q.scales, q.zeros + 0.37, False)
    back = unpack_matmul_nbits(pack_matmul_nbits(q), k, bits, group)
    assert (back.bits, back.group_size, back.symmetric) == (bits, group, symmetric)
    for field in ("codes", "scales", "zeros"):
        assert torch.equal(getattr(back, field), getattr(q, field)), field


@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, False), (8, True)])
def test_dequantize_linear_unpacks_to_the_same_linear(bits, symmetric):
    from llmopt.compiler.quant_format import pack_dequantize_linear, unpack_dequantize_linear

    q = group_quantize(weight(40, 96), bits, 32, symmetric)
    back = unpack_dequantize_linear(pack_dequantize_linear(q), 32)
    assert (back.bits, back.symmetric) == (bits, symmetric)
    for field in ("codes", "scales", "zeros"):
        assert torch.equal(getattr(back, field), getattr(q, field)), field


def test_split_fractional_zeros_joins_back_and_fused_rows_slice_out():
    from llmopt.compiler.quant_format import (
        join_fractional_zeros,
        slice_outputs,
        split_fractional_zeros,
    )

    q = group_quantize(weight(16, 72), 4, 32, symmetric=False)
    q = QuantizedLinear(4, 32, q.codes, q.scales, q.zeros + 0.37, False)
    back = join_fractional_zeros(*split_fractional_zeros(q))
    assert torch.equal(back.codes, q.codes) and not back.symmetric
    torch.testing.assert_close(back.zeros, q.zeros, rtol=0, atol=1e-4)
    torch.testing.assert_close(back.dequantize(), q.dequantize(), rtol=0, atol=1e-6)
    a, b = group_quantize(weight(8, 72, 1), 4, 32, False), group_quantize(weight(5, 72, 2),
                                                                         4, 32, False)
    fused = concat_outputs([a, b])
    assert torch.equal(slice_outputs(fused, 8, 13).codes, b.codes)
    assert torch.equal(slice_outputs(fused, 0, 8).scales, a.scales)
