"""H2O's accumulated attention on ONNX Runtime: beside a lanes layer's GroupQueryAttention,
which returns no attention weights, an unfused branch computing each step's weights and
summing them over each KV head's query group and the step's tokens.

Output `attention_sums.{layer}` [B, kv_heads, T] (T = total_sequence_length): row b's
sum over its valid query tokens s and the group's heads of softmax(scale * q . k) over
its lane's keys 0 .. T - 1, where key j is visible to the token at position p when j <= p
(and p - j < window), as the node sees them. The runtime adds it to a lane's rows
(`kv.h2o`), as the native step's accumulator does. Keys are read back from the node's
present output (the lane, the step's keys written), decoded from the lane's format.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from llmopt.compiler.ir import LayerSpec
from llmopt.compiler.onnx_graph import GraphBuilder
from llmopt.runtime import contract as C


def emit_attention_sums(g: GraphBuilder, q: str, present_key: str, positions: str,
                        spec: LayerSpec, index: int, scale: float, softcap: float | None,
                        key_scale: str | None) -> None:
    """The layer's output `attention_sums.{index}` from its rotated queries q [B, S,
    heads * dim] (float32), its present keys and the step's positions [B, S] (int64)."""
    kv, dim = spec.num_kv_heads, spec.head_dim
    group = spec.num_heads // kv
    total = g.op("Cast", [g.op("Reshape", [C.TOTAL_SEQUENCE_LENGTH, g.const([1])])],
                 to=TensorProto.INT64)
    keys = _decoded(g, g.op("Slice", [present_key, g.const([0]), total, g.const([2])]),
                    spec, key_scale)  # [B, kv, T, dim]
    queries = g.op("Transpose", [g.op("Reshape", [q, g.const([0, 0, kv, group, dim])])],
                   perm=[0, 2, 1, 3, 4])  # [B, kv, S, group, dim]
    keys_t = g.op("Unsqueeze", [g.op("Transpose", [keys], perm=[0, 1, 3, 2]), g.const([2])])
    scores = g.op("Mul", [g.op("MatMul", [queries, keys_t]), g.const(scale, np.float32)])
    if softcap:
        cap = g.const(softcap, np.float32)
        scores = g.op("Mul", [g.op("Tanh", [g.op("Div", [scores, cap])]), cap])
    visible = _visible(g, positions, total, spec.sliding_window)  # [B, 1, S, 1, T]
    scores = g.op("Where", [visible, scores, g.const(-np.inf, np.float32)])
    weights = g.op("Mul", [g.op("Softmax", [scores], axis=-1), _valid_rows(g)])
    g.op_into("ReduceSum", [weights, g.const([2, 3])], [C.attention_sums_name(index)],
              keepdims=0)
    g.output(C.attention_sums_name(index), TensorProto.FLOAT,
             ["batch", kv, "total_sequence_length"])


def _decoded(g: GraphBuilder, keys: str, spec: LayerSpec, key_scale: str | None) -> str:
    """Lane key rows [B, kv, T, stored width] as float32 [B, kv, T, dim]."""
    if spec.kv_dtype in ("float32", "float16"):
        return keys if spec.kv_dtype == "float32" else g.op("Cast", [keys], to=TensorProto.FLOAT)
    if spec.kv_dtype == "int4":  # element 2j in the low nibble of byte j, codes + 8
        high = g.op("BitShift", [keys, g.const(4, np.uint8)], direction="RIGHT")
        low = g.op("Sub", [keys, g.op("BitShift", [high, g.const(4, np.uint8)],
                                       direction="LEFT")])
        pairs = g.op("Concat", [g.op("Unsqueeze", [x, g.const([-1])]) for x in (low, high)],
                     axis=-1)
        codes = g.op("Reshape", [pairs, g.const([0, 0, 0, spec.head_dim])])
        keys = g.op("Sub", [g.op("Cast", [codes], to=TensorProto.FLOAT),
                            g.const(8.0, np.float32)])
    else:
        keys = g.op("Cast", [keys], to=TensorProto.FLOAT)
    assert key_scale is not None, "KV codes without static key scales"
    scale = g.op("Reshape", [key_scale, g.const([1, spec.num_kv_heads, 1, spec.head_dim])])
    return g.op("Mul", [keys, scale])


def _visible(g: GraphBuilder, positions: str, total: str, window: int | None) -> str:
    """Key j visible to the token at position p: j <= p, and p - j < window."""
    keys = g.op("Range", [g.const(0), g.op("Squeeze", [total]), g.const(1)])  # [T]
    p = g.op("Unsqueeze", [positions, g.const([2])])  # [B, S, 1]
    visible = g.op("LessOrEqual", [keys, p])  # [B, S, T]
    if window is not None:
        visible = g.op("And", [visible, g.op("Less", [g.op("Sub", [p, keys]),
                                                      g.const(window)])])
    return g.op("Unsqueeze", [visible, g.const([1, 3])])


def _valid_rows(g: GraphBuilder) -> str:
    """1.0 for each row's valid query tokens (s < query_seqlens[b]), [B, 1, S, 1, 1]."""
    width = g.op("Gather", [g.op("Shape", [C.INPUT_IDS]), g.const(1)], axis=0)
    s = g.op("Range", [g.const(0), width, g.const(1)])  # [S]
    lengths = g.op("Unsqueeze", [g.op("Cast", [C.QUERY_SEQLENS], to=TensorProto.INT64),
                                 g.const([1])])  # [B, 1]
    valid = g.op("Cast", [g.op("Less", [s, lengths])], to=TensorProto.FLOAT)
    return g.op("Unsqueeze", [valid, g.const([1, 3, 4])])
