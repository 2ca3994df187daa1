"""The native step's plan, typed: what the compiler decided (compiler/native_plan.py) and
the runtime loads (weights.py), kept in the manifest's `native` section of a graph.

`NativePlan.from_manifest` and `to_manifest` convert to and from that section's JSON,
field for field and key for key in the order the manifest has always written them, so
artifacts compiled before the types existed load unchanged and new ones are byte-identical.
A graph the native step cannot run has `{"unsupported": reason}` there (`Unsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Tensor:
    """A weight: `length` bytes at `offset` in the graph's weights file, or (small ones,
    kept inside the ONNX file) its `values`, flat."""

    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None
    length: int | None = None
    values: tuple[float, ...] | None = None

    @classmethod
    def from_manifest(cls, record: Json) -> Tensor:
        values = record.get("values")
        return cls(record["dtype"], tuple(record["shape"]), record.get("offset"),
                   record.get("length"), None if values is None else tuple(values))

    def to_manifest(self) -> Json:
        record: Json = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.values is not None:
            return {**record, "values": list(self.values)}
        return {**record, "offset": self.offset, "length": self.length}


def _tensor(record: Json | None) -> Tensor | None:
    return None if record is None else Tensor.from_manifest(record)


def _record(tensor: Tensor | None) -> Json | None:
    return None if tensor is None else tensor.to_manifest()


@dataclass(frozen=True)
class QuantizedMatrix:
    """A projection w [n, k] as MatMulNBits holds it: `bits`-bit codes in blocks of `block`
    columns, scales, optional zero points, fractional zero points' group offsets (GGUF
    Q4_1) and a bias added to its output."""

    codes: Tensor
    scales: Tensor
    zeros: Tensor | None
    bits: int
    block: int
    n: int
    k: int
    offsets: Tensor | None = None
    bias: Tensor | None = None
    # MatMulBnb4's 16 values (NF4, FP4): codes are bitsandbytes-packed [N*K/2] (high
    # nibble first) and scales the block absmax [N*K/block] (runtime/native/codebook.py).
    codebook: tuple[float, ...] | None = None

    @classmethod
    def from_manifest(cls, record: Json) -> QuantizedMatrix:
        codebook = record.get("codebook")
        return cls(Tensor.from_manifest(record["codes"]), Tensor.from_manifest(record["scales"]),
                   _tensor(record["zeros"]), record["bits"], record.get("block", 32),
                   record["n"], record["k"], _tensor(record.get("offsets")),
                   _tensor(record.get("bias")), None if codebook is None else tuple(codebook))

    def to_manifest(self) -> Json:
        record = {"codes": self.codes.to_manifest(), "scales": self.scales.to_manifest(),
                  "zeros": _record(self.zeros), "offsets": _record(self.offsets),
                  "bias": _record(self.bias), "bits": self.bits, "block": self.block,
                  "n": self.n, "k": self.k}
        if self.codebook is not None:  # absent otherwise: older manifests stay byte-identical
            record["codebook"] = list(self.codebook)
        return record


@dataclass(frozen=True)
class EmbeddingRows:
    """Embedding rows as GatherBlockQuantized reads them (the tied LM head's codes)."""

    codes: Tensor
    scales: Tensor
    zeros: Tensor | None
    bits: int
    block: int
    n: int
    k: int

    @classmethod
    def from_manifest(cls, record: Json) -> EmbeddingRows:
        return cls(Tensor.from_manifest(record["codes"]), Tensor.from_manifest(record["scales"]),
                   _tensor(record["zeros"]), record["bits"], record.get("block", 32),
                   record["n"], record["k"])

    def to_manifest(self) -> Json:
        return {"codes": self.codes.to_manifest(), "scales": self.scales.to_manifest(),
                "zeros": _record(self.zeros), "bits": self.bits, "block": self.block,
                "n": self.n, "k": self.k}


@dataclass(frozen=True)
class LaneKV:
    """How a layer's lanes hold keys and values other than float32: float16 (bits 16), or
    int8/int4 codes of static per-channel scales; `rotation` of queries and keys, if any."""

    bits: int
    key_scale: Tensor | None
    value_scale: Tensor | None
    rotation: Tensor | None

    @classmethod
    def from_manifest(cls, record: Json | None) -> LaneKV | None:
        if record is None:
            return None
        return cls(record["bits"], _tensor(record["key_scale"]), _tensor(record["value_scale"]),
                   _tensor(record["rotation"]))

    def to_manifest(self) -> Json:
        return {"bits": self.bits, "key_scale": _record(self.key_scale),
                "value_scale": _record(self.value_scale), "rotation": _record(self.rotation)}


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: its norms, its four projections (q/k/v and gate/up fused), its
    lanes' format (None: float32) and Qwen3's norms of each query and key head, if any."""

    attn_norm: Tensor
    mlp_norm: Tensor
    qkv: QuantizedMatrix
    o: QuantizedMatrix
    gate_up: QuantizedMatrix
    down: QuantizedMatrix
    kv: LaneKV | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None

    @classmethod
    def from_manifest(cls, record: Json) -> LayerPlan:
        matrices = {key: QuantizedMatrix.from_manifest(record[key])
                    for key in ("qkv", "o", "gate_up", "down")}
        return cls(Tensor.from_manifest(record["attn_norm"]),
                   Tensor.from_manifest(record["mlp_norm"]), **matrices,
                   kv=LaneKV.from_manifest(record.get("kv")),
                   q_norm=_tensor(record.get("q_norm")), k_norm=_tensor(record.get("k_norm")))

    def to_manifest(self) -> Json:
        return {"attn_norm": self.attn_norm.to_manifest(),
                "mlp_norm": self.mlp_norm.to_manifest(), "qkv": self.qkv.to_manifest(),
                "o": self.o.to_manifest(), "gate_up": self.gate_up.to_manifest(),
                "down": self.down.to_manifest(),
                "kv": None if self.kv is None else self.kv.to_manifest(),
                "q_norm": _record(self.q_norm), "k_norm": _record(self.k_norm)}


@dataclass(frozen=True)
class NativePlan:
    """A lanes graph the native step runs: shapes, and where every weight lies. `embed` is
    a float table (Tensor) or the tied head's rows (EmbeddingRows); `window` a sliding
    window every layer shares (None: none)."""

    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    attn_scale: float
    rope_cos: Tensor
    rope_sin: Tensor
    embed: Tensor | EmbeddingRows
    layers: tuple[LayerPlan, ...]
    final_norm: Tensor
    head: QuantizedMatrix
    hidden: int
    intermediate: int
    vocab: int
    window: int | None = None

    @classmethod
    def from_manifest(cls, record: Json) -> NativePlan:
        embed = record["embed"]
        return cls(
            record["eps"], record["heads"], record["kv_heads"], record["head_dim"],
            record["attn_scale"], Tensor.from_manifest(record["rope"]["cos"]),
            Tensor.from_manifest(record["rope"]["sin"]),
            Tensor.from_manifest(embed["table"]) if "table" in embed
            else EmbeddingRows.from_manifest(embed["codes"]),
            tuple(LayerPlan.from_manifest(layer) for layer in record["layers"]),
            Tensor.from_manifest(record["final_norm"]),
            QuantizedMatrix.from_manifest(record["head"]), record["hidden"],
            record["intermediate"], record["vocab"], record.get("window"))

    def to_manifest(self) -> Json:
        embed = ({"table": self.embed.to_manifest()} if isinstance(self.embed, Tensor)
                 else {"codes": self.embed.to_manifest()})
        record: Json = {
            "eps": self.eps, "heads": self.heads, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "attn_scale": self.attn_scale,
            "rope": {"cos": self.rope_cos.to_manifest(), "sin": self.rope_sin.to_manifest()},
            "embed": embed, "layers": [layer.to_manifest() for layer in self.layers],
            "final_norm": self.final_norm.to_manifest(), "head": self.head.to_manifest()}
        if self.window is not None:
            record["window"] = self.window
        return {**record, "hidden": self.hidden, "intermediate": self.intermediate,
                "vocab": self.vocab}


@dataclass(frozen=True)
class Unsupported:
    """A graph the native step cannot run, and why (ONNX Runtime runs it); the rotary
    tables its layers share, if they share one (what evicting lanes turns keys with)."""

    reason: str
    rope_cos: Tensor | None = None
    rope_sin: Tensor | None = None

    def to_manifest(self) -> Json:
        record: Json = {"unsupported": self.reason}
        if self.rope_cos is not None and self.rope_sin is not None:
            record["rope"] = {"cos": self.rope_cos.to_manifest(),
                              "sin": self.rope_sin.to_manifest()}
        return record


def read_plan(native: Json | None) -> NativePlan | Unsupported | None:
    """A graph's manifest `native` section, typed (None: compiled before native plans)."""
    if native is None:
        return None
    if "unsupported" in native:
        rope = native.get("rope", {})
        return Unsupported(native["unsupported"], _tensor(rope.get("cos")),
                           _tensor(rope.get("sin")))
    return NativePlan.from_manifest(native)


def rotary_tables(plan: NativePlan | Unsupported | None) -> tuple[Tensor, Tensor] | None:
    """The graph's rotary tables (cos, sin [positions, head_dim / 2]) where its manifest
    names them, whether or not the native step runs it."""
    if isinstance(plan, NativePlan):
        return plan.rope_cos, plan.rope_sin
    if isinstance(plan, Unsupported) and plan.rope_cos is not None and plan.rope_sin is not None:
        return plan.rope_cos, plan.rope_sin
    return None
