"""The operators the lowering may use, chosen by the target.

`OrtOps` uses ONNX Runtime's fused contrib operators (RMSNorm with residual add,
rotary embedding); `StandardOps` spells the same math in standard ONNX only, for
backends such as TensorRT. The lowering calls one interface and never branches on
the target itself.
"""

from __future__ import annotations

import numpy as np
from llmopt.compiler.onnx_graph import MS_DOMAIN, GraphBuilder


class StandardOps:
    """Standard ONNX operators only."""

    operator_set = "standard"

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
    """ONNX Runtime contrib operators where they exist (fewer nodes per layer)."""

    operator_set = "onnxruntime"

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
