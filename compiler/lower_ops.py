"""The operators the lowering may use, chosen by the target.

`OrtOps` uses ONNX Runtime's fused contrib operators (RMSNorm with residual add,
rotary embedding); `StandardOps` spells the same math in standard ONNX only, for
backends such as TensorRT. The lowering calls one interface and never branches on
the target itself.
"""

from __future__ import annotations

import numpy as np

from llmopt.compiler.ir import LayerSpec
from llmopt.compiler.onnx_graph import MS_DOMAIN, GraphBuilder


class StandardOps:
    """Standard ONNX operators only (opset 21: what TensorRT's parser takes)."""

    operator_set = "standard"
    opset = 21
    quantized_matmul = "dequantize_linear"

    def __init__(self, g: GraphBuilder, eps: float):
        self.g, self.eps = g, eps
        self._rope_cache: dict[str, tuple[str, str]] = {}

    def rms_norm(self, x: str, weight: str) -> str:
        g = self.g
        mean_square = g.op("ReduceMean", [g.op("Mul", [x, x]), g.const([-1])], keepdims=1)
        inv_rms = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean_square, self._eps()])])])
        return g.op("Mul", [g.op("Mul", [x, inv_rms]), weight], name="rms_norm")

    def add_rms_norm(self, x: str, residual: str, weight: str) -> tuple[str, str]:
        """(norm(x + residual), x + residual)."""
        total = self.g.op("Add", [residual, x], name="residual")
        return self.rms_norm(total, weight), total

    def rotary(self, x: str, num_heads: int, head_dim: int, table: str,
               position_ids: str) -> str:
        """Rotate-half RoPE on x [B, S, heads*head_dim]."""
        g = self.g
        cos, sin = self._cos_sin(table, position_ids)
        heads = g.op("Reshape", [x, g.const([0, 0, num_heads, head_dim])])
        x1, x2 = g.op("Split", [heads, g.const([head_dim // 2] * 2)], axis=-1, outputs=2)
        rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        out = g.op("Add", [g.op("Mul", [heads, cos]), g.op("Mul", [rotated, sin])], name="rope")
        return g.op("Reshape", [out, g.const([0, 0, -1])])

    def attention(self, q: str, keys: str, values: str, mask: str, spec: LayerSpec,
                  scale: float, softcap: float | None) -> str:
        """Grouped-query attention. q [B, S, heads*D]; keys/values [B, L, kv_heads*D];
        mask [B, 1, S, L] additive. Returns [B, S, heads*D]."""
        g = self.g
        kv_heads, dim = spec.num_kv_heads, spec.head_dim
        groups = spec.num_heads // kv_heads
        # Queries grouped by their KV head: [B, kv_heads, groups * S, D].
        q = g.op("Reshape", [q, g.const([0, 0, kv_heads, groups, dim])])
        q = g.op("Transpose", [q], perm=[0, 2, 3, 1, 4])
        q = g.op("Reshape", [q, g.const([0, 0, -1, dim])])
        k = g.op("Reshape", [keys, g.const([0, 0, kv_heads, dim])])
        k_t = g.op("Transpose", [k], perm=[0, 2, 3, 1])  # [B, kv_heads, D, L]
        v = g.op("Reshape", [values, g.const([0, 0, kv_heads, dim])])
        v = g.op("Transpose", [v], perm=[0, 2, 1, 3])  # [B, kv_heads, L, D]
        scores = g.op("MatMul", [q, k_t], name="scores")
        scores = g.op("Mul", [scores, g.const(scale, np.float32)])
        if softcap:
            cap = g.const(softcap, np.float32)
            scores = g.op("Mul", [g.op("Tanh", [g.op("Div", [scores, cap])]), cap])
        if groups > 1:  # mask rows follow the query rows: group-major
            mask = g.op("Tile", [mask, g.const([1, 1, groups, 1])])
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
        out = g.op("MatMul", [probs, v], name="attn")  # [B, kv_heads, groups * S, D]
        out = g.op("Reshape", [out, g.const([0, 0, groups, -1, dim])])
        out = g.op("Transpose", [out], perm=[0, 3, 1, 2, 4])  # [B, S, kv_heads, groups, D]
        return g.op("Reshape", [out, g.const([0, 0, -1])])

    def _cos_sin(self, table: str, position_ids: str) -> tuple[str, str]:
        """cos/sin [B, S, 1, head_dim] for this step, computed once per table."""
        if table not in self._rope_cache:
            g = self.g
            halves = [g.op("Gather", [f"{table}.{f}", position_ids]) for f in ("cos", "sin")]
            full = [g.op("Concat", [h, h], axis=-1) for h in halves]
            cos, sin = (g.op("Unsqueeze", [f, g.const([2])]) for f in full)
            self._rope_cache[table] = (cos, sin)
        return self._rope_cache[table]

    def _eps(self) -> str:
        return self.g.const(self.eps, np.float32)


class OrtOps(StandardOps):
    """ONNX Runtime's fused operators where they exist (fewer nodes per layer)."""

    operator_set = "onnxruntime"
    opset = 23  # for the fused standard Attention operator
    quantized_matmul = "matmul_nbits"

    def attention(self, q: str, keys: str, values: str, mask: str, spec: LayerSpec,
                  scale: float, softcap: float | None) -> str:
        # One node, reading the 3-D [B, L, kv_heads*D] keys as they were gathered:
        # no transposes of the KV, no head repetition.
        return self.g.op("Attention", [q, keys, values, mask], name="attention",
                         q_num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads,
                         scale=scale, softcap=softcap or 0.0)

    def rms_norm(self, x: str, weight: str) -> str:
        return self.g.op("SimplifiedLayerNormalization", [x, weight], name="rms_norm",
                         axis=-1, epsilon=self.eps, stash_type=1)

    def add_rms_norm(self, x: str, residual: str, weight: str) -> tuple[str, str]:
        normed, _, _, total = self.g.op(
            "SkipSimplifiedLayerNormalization", [x, residual, weight], name="add_rms_norm",
            outputs=4, domain=MS_DOMAIN, epsilon=self.eps,
        )
        return normed, total

    def rotary(self, x: str, num_heads: int, head_dim: int, table: str,
               position_ids: str) -> str:
        return self.g.op(
            "RotaryEmbedding", [x, position_ids, f"{table}.cos", f"{table}.sin"], name="rope",
            domain=MS_DOMAIN, interleaved=0, num_heads=num_heads,
        )


OPERATOR_SETS = {"onnxruntime": OrtOps, "standard": StandardOps}
