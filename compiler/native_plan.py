"""The native step's plan, emitted by the lowering: what it decided for each weight of a lanes
graph, and where that weight lies, for `llmopt.runtime.native`.

The runtime's native decoder step (one C call per step, see runtime/native/kernels.c)
computes what a lanes graph computes, for the models it knows: a llama-style decoder (RMS
norms, fused QKV and gate/up projections, SiLU, GroupQueryAttention with rotary, no softcap;
biases added to projections, as Qwen2's q/k/v, and RMS norms of each query and key head
before rotary, as Qwen3's, are taken; a sliding window every layer shares, as Mistral's,
is recorded, and each query reads only its window of its lane) whose
projections are MatMulNBits at accuracy level 4 with 4- or 8-bit codes in blocks of 32, 64
or 128 (or MatMulBnb4's NF4/FP4 code books), and KV lanes of float32 or, per layer, the
KV-cache pass's float16 or int8/int4 codes with static per-channel scales.

compiler/lower.py tells a `PlanRecorder` each decision as it emits the nodes that carry it:
a projection's codes, a layer's lanes and attention, the embedding and the rotary tables;
and, as the reason the step cannot run the graph, anything it emits that the step does not
compute (a float projection, GELU, a softcap, norms after attention, float activations).
Once the graph is saved, `resolve` finds each named weight among its initializers (an
offset of the weights file, or its values inline when small enough to stay in the ONNX
file) and returns the typed plan (runtime/native/plan.py's NativePlan) or Unsupported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmopt.compiler.nf4 import FP4_CODE, NF4_CODE
from llmopt.runtime.native.plan import (
    EmbeddingRows,
    LaneKV,
    LayerPlan,
    NativePlan,
    QuantizedMatrix,
    Tensor,
    Unsupported,
)

if TYPE_CHECKING:
    from llmopt.compiler.ir import ArchSpec

_BLOCKS = (32, 64, 128)  # the kernels' quantization blocks, for weights and activations
_SLICE = 32  # the columns of the kernels' packed layout: every K is a multiple
_VECTOR = 16  # float32 lanes of the kernels' vectors: every width is a multiple

# MatMulBnb4's quant_type -> its code book (ONNX Runtime's built-in FP4 and NF4 tables).
BNB4_CODEBOOKS = {0: tuple(FP4_CODE.tolist()), 1: tuple(NF4_CODE.tolist())}
# A layer's fused projections, by the lowering's names for them.
_PROJECTIONS = {"qkv": "q_proj_k_proj_v_proj", "o": "o_proj", "gate_up": "gate_proj_up_proj",
                "down": "down_proj"}


@dataclass
class MatrixNames:
    """A projection as the lowering emitted it: its initializers' names and its codes' form."""

    codes: str
    scales: str
    zeros: str | None
    bits: int
    block: int
    n: int
    k: int
    offsets: str | None = None  # fractional zero points' group offsets (GGUF Q4_1)
    bias: str | None = None
    codebook: tuple[float, ...] | None = None


@dataclass(frozen=True)
class LaneNames:
    """A layer's lanes other than float32: float16 (bits 16) or int codes of static scales."""

    bits: int
    key_scale: str | None = None
    value_scale: str | None = None
    rotation: str | None = None


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    rope: str  # the rotary tables' prefix, `rope.{name}`
    window: int | None


@dataclass
class PlanRecorder:
    """What the lowering decided, by initializer name; the first reason the native step
    cannot run the graph, if any."""

    arch: ArchSpec
    reason: str | None = None
    matrices: dict[str, MatrixNames] = field(default_factory=dict)  # by fused weight name
    lanes: dict[int, LaneNames] = field(default_factory=dict)  # layers not float32
    attention: dict[int, AttentionShape] = field(default_factory=dict)
    head_norms: set[int] = field(default_factory=set)  # layers with Qwen3's q/k norms
    embed: str | MatrixNames | None = None  # a float table, or the tied head's rows

    def unsupported(self, reason: str) -> None:
        self.reason = self.reason or reason

    def projection(self, name: str, matrix: MatrixNames) -> None:
        if matrix.bits not in (4, 8) or matrix.block not in _BLOCKS:
            self.unsupported(f"{name}: {matrix.bits}-bit codes in blocks of {matrix.block} "
                             "(the native step takes 4/8-bit; 32, 64, 128)")
        elif matrix.k % _SLICE or (matrix.codebook and matrix.k % matrix.block):
            self.unsupported(f"{name}: K {matrix.k} is not a multiple of {_SLICE} and of "
                             f"its blocks")
        offsets = self.matrices[name].offsets if name in self.matrices else None
        matrix.offsets = matrix.offsets or offsets
        self.matrices[name] = matrix

    def group_offsets(self, name: str, offsets: str) -> None:
        """`name`'s output gains MatMul(group sums, offsets): its codes follow."""
        self.matrices[name] = MatrixNames("", "", None, 0, 0, 0, 0, offsets=offsets)

    def bias(self, name: str, bias: str) -> None:
        if name in self.matrices:
            self.matrices[name].bias = bias

    def resolve(self, model: onnx.ModelProto) -> NativePlan | Unsupported:
        """The plan, each named weight located among the saved graph's initializers."""
        reason = self._reason()
        if reason is not None:
            return self._unsupported(model, reason)
        return _Locator(model).plan(self, self.attention[0])

    def _reason(self) -> str | None:
        """Why the native step cannot run the graph, or None."""
        if self.reason is not None:
            return self.reason
        shapes = set(self.attention.values())
        if len(shapes) != 1:
            return "layers with different attention shapes or sliding windows"
        shape = shapes.pop()
        if shape.head_dim > 256 or shape.head_dim % _VECTOR or self.arch.hidden_size % _VECTOR:
            return (f"hidden size {self.arch.hidden_size} or head_dim {shape.head_dim} is not "
                    f"a multiple of {_VECTOR} (head_dim up to 256)")
        if (shape.heads // shape.kv_heads) * shape.head_dim > 8 * 256:
            return (f"{shape.heads // shape.kv_heads} query heads of {shape.head_dim} share a "
                    "KV head")
        return None

    def _unsupported(self, model: onnx.ModelProto, reason: str) -> Unsupported:
        """`reason`, with the rotary tables of a lanes graph whose layers share one (the
        runtime turns evicted lanes' keys with them: `kv.compaction`); none where keys are
        stored rotated, whose rotation only a plan names."""
        ropes = {shape.rope for shape in self.attention.values()}
        if len(ropes) != 1 or any(lanes.rotation for lanes in self.lanes.values()):
            return Unsupported(reason)
        locator, rope = _Locator(model), ropes.pop()
        return Unsupported(reason, locator.tensor(f"{rope}.cos"), locator.tensor(f"{rope}.sin"))


class _Locator:
    """Initializers of a saved graph by name, as plan tensors."""

    def __init__(self, model: onnx.ModelProto):
        self.tensors = {t.name: t for t in model.graph.initializer}

    def plan(self, names: PlanRecorder, shape: AttentionShape) -> NativePlan:
        arch = names.arch
        layers = tuple(self._layer(names, i) for i in range(arch.num_layers))
        head = self._matrix(names.matrices["lm_head"])
        embed = (self.tensor(names.embed) if isinstance(names.embed, str)
                 else self._rows(names.embed))
        # as the graph's float32 attributes hold them (the norms' epsilon rounded as written)
        eps, scale = round(float(np.float32(arch.norm_eps)), 12), float(np.float32(shape.scale))
        return NativePlan(
            eps, shape.heads, shape.kv_heads, shape.head_dim, scale,
            self.tensor(f"{shape.rope}.cos"), self.tensor(f"{shape.rope}.sin"), embed, layers,
            self.tensor("final_norm"), head, layers[0].o.n, layers[0].down.k, head.n,
            shape.window)

    def _layer(self, names: PlanRecorder, index: int) -> LayerPlan:
        p = f"layers.{index}."
        matrices = {key: self._matrix(names.matrices[p + fused])
                    for key, fused in _PROJECTIONS.items()}
        lanes = names.lanes.get(index)
        kv = None if lanes is None else LaneKV(
            lanes.bits, self.optional(lanes.key_scale), self.optional(lanes.value_scale),
            self.optional(lanes.rotation))
        normed = index in names.head_norms
        return LayerPlan(self.tensor(p + "attn_norm"), self.tensor(p + "mlp_norm"), **matrices,
                         kv=kv, q_norm=self.tensor(p + "q_norm") if normed else None,
                         k_norm=self.tensor(p + "k_norm") if normed else None)

    def _matrix(self, m: MatrixNames) -> QuantizedMatrix:
        return QuantizedMatrix(self.tensor(m.codes), self.tensor(m.scales),
                               self.optional(m.zeros), m.bits, m.block, m.n, m.k,
                               self.optional(m.offsets), self.optional(m.bias), m.codebook)

    def _rows(self, m: MatrixNames) -> EmbeddingRows:
        return EmbeddingRows(self.tensor(m.codes), self.tensor(m.scales),
                             self.optional(m.zeros), m.bits, m.block, m.n, m.k)

    def optional(self, name: str | None) -> Tensor | None:
        return None if name is None else self.tensor(name)

    def tensor(self, name: str) -> Tensor:
        t = self.tensors[name]
        dtype, shape = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).name, tuple(t.dims)
        external = {e.key: e.value for e in t.external_data}
        if external:
            return Tensor(dtype, shape, int(external.get("offset", 0)), int(external["length"]))
        return Tensor(dtype, shape, values=tuple(numpy_helper.to_array(t).reshape(-1).tolist()))
