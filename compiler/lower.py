"""Lower ModelIR to one ONNX decoder graph with the paged-KV contract.

See `llmopt.runtime.contract` for the inputs and outputs. Attention gathers only the
blocks named in the block tables, concatenates the step's own keys/values, and masks
by context length, causality and sliding window. The mask is built once per step and
shared by every layer with the same window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from onnx import TensorProto

from llmopt.compiler.ir import ArchSpec, LayerSpec, ModelIR
from llmopt.compiler.kv_cache_format import (
    KVSide,
    block_side,
    emit_block_decode,
    emit_block_encode,
    emit_decode,
    emit_encode,
    emit_rotate_heads,
    emit_round_trip,
    half_precision_attention,
    kv_sides,
    static_scale_initializer,
)
from llmopt.compiler.lower_ops import OPERATOR_SETS, StandardOps
from llmopt.compiler.onnx_graph import MS_DOMAIN, NP_TO_ONNX, GraphBuilder
from llmopt.compiler.quant_format import (
    QuantizedLinear,
    concat_outputs,
    group_sum_matrix,
    pack_dequantize_linear,
    pack_matmul_nbits,
    split_fractional_zeros,
)
from llmopt.runtime import contract as C

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe

WEIGHT_DTYPES = {"float32": np.float32, "float16": np.float16}
_NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class LoweringOptions:
    operator_set: str = "onnxruntime"  # or "standard"
    weight_dtype: str = "float32"  # storage dtype of weights; compute stays float32
    max_position: int | None = None  # rotary table length; default: the model's
    # MatMulNBits' accuracy_level: 0 computes in float32 (exactly the fake-quantized model);
    # 4 quantizes activations to int8 per block (faster on CPUs with VNNI, not exact).
    nbits_accuracy_level: int = 0
    # "matmul_nbits" (ONNX Runtime's int4/int8 kernel) or "dequantize_linear" (standard
    # ONNX; ONNX Runtime fuses it back into MatMulNBits); None: the operator set's choice.
    quantized_matmul: str | None = None
    # How the KV pool is laid out (see llmopt.runtime.contract): "blocks" gathers a step's
    # blocks and attends over the copy; "lanes" gives each sequence a contiguous lane that
    # ONNX Runtime's GroupQueryAttention reads and appends to in place.
    kv_layout: str = "blocks"


def lowering_options(recipe: Recipe, arch: ArchSpec) -> LoweringOptions:
    """How a recipe's target lowers a model (the target, or its draft)."""
    return LoweringOptions(
        operator_set=recipe.target.operator_set,
        weight_dtype=recipe.target.weight_dtype,
        max_position=min(arch.max_position, recipe.runtime.max_context),
        nbits_accuracy_level=recipe.target.nbits_accuracy_level,
        quantized_matmul=None if recipe.target.quantized_matmul == "auto"
        else recipe.target.quantized_matmul,
        kv_layout=kv_layout_for(recipe.target.kv_layout, recipe.target.operator_set, arch),
    )


def kv_layout_for(choice: str, operator_set: str, arch: ArchSpec) -> str:
    """The KV layout a target gets: lanes wherever GroupQueryAttention can run the model
    (`auto`), else blocks; asking for lanes where it cannot is an error naming why."""
    reason = lanes_unsupported(operator_set, arch)
    if choice == "auto":
        return "blocks" if reason else "lanes"
    if choice == "lanes" and reason:
        raise ValueError(f"target.kv_layout: lanes {reason}")
    return choice


def lanes_unsupported(operator_set: str, arch: ArchSpec) -> str | None:
    """Why GroupQueryAttention cannot run this model in place (None: it can)."""
    if operator_set != "onnxruntime":
        return "needs the onnxruntime operator set (GroupQueryAttention is a contrib operator)"
    for index, spec in enumerate(arch.layers):
        if spec.kv_sink_tokens:
            return ("needs no sink tokens (GroupQueryAttention attends to every position as "
                    f"stored; layer {index} keeps {spec.kv_sink_tokens} unrounded)")
        if not lane_storable(spec):
            return ("needs float32, or int8/int4 with static channel scales on both sides "
                    f"(layer {index} stores {spec.kv_dtype})")
        if spec.num_heads % spec.num_kv_heads:
            return f"needs query heads in whole groups per KV head (layer {index})"
        if spec.head_dim % 16:  # ONNX Runtime's CPU kernel refuses other sizes
            return f"needs a head size that is a multiple of 16 (layer {index}: {spec.head_dim})"
    return None


def lane_storable(spec: LayerSpec) -> bool:
    """Whether ONNX Runtime's CPU GroupQueryAttention stores this layer's KV dtype in place:
    float32 as is; float16, with the queries and the attention output in float16 too (the
    node has one type; under float32 queries a float16 cache makes ONNX Runtime 1.32 rewrite
    every row's lane from the step's first position to the end, clobbering idle lanes);
    int8 and int4 (two codes a byte, low nibble first, code + 8: the static int4 of
    kv_cache_format) with one static scale per channel."""
    static = spec.kv_key_scales == "channel" and spec.kv_value_scales == "channel"
    return spec.kv_dtype in ("float32", "float16") or (
        spec.kv_dtype in ("int8", "int4") and static)


def kv_cache_spec(arch: ArchSpec, layout: str) -> dict:
    """The manifest's `kv_cache` section for a model lowered with `layout`."""
    return {"layout": layout,
            "layers": [{"tensors": cache_tensors(spec, layout), "sink": sink_tensors(spec),
                        "tail": tail_tensors(spec)} for spec in arch.layers],
            "sink_tokens": max(spec.kv_sink_tokens for spec in arch.layers),
            "block_size": max((spec.kv_block_size for spec in arch.layers if spec.kv_block_size),
                              default=None)}


def sink_tensors(spec: LayerSpec) -> list[dict]:
    """The manifest's sink tensors of one layer: its keys and values in float32 for the
    first `kv_sink_tokens` positions (none when it keeps no sinks)."""
    width = spec.num_kv_heads * spec.head_dim
    return [{"name": name, "dtype": "float32", "slot_shape": [width]}
            for name in ("key", "value")] if spec.kv_sink_tokens else []


def tail_tensors(spec: LayerSpec) -> list[dict]:
    """The manifest's tail tensors of one layer: its keys in float32 while their block
    fills (per-block key scales only)."""
    width = spec.num_kv_heads * spec.head_dim
    return ([{"name": "key", "dtype": "float32", "slot_shape": [width]}]
            if kv_sides(spec)[0].per_block else [])


def lower_to_onnx(ir: ModelIR, options: LoweringOptions) -> onnx.ModelProto:
    return _DecoderLowering(ir, options).build()


def cache_tensors(spec: LayerSpec, layout: str = "blocks") -> list[dict]:
    """The manifest's description of one layer's pool tensors (keys', then values').

    Blocks: a slot holds all KV heads of a token side by side, [kv_heads * head_dim]
    (packed for int4, plus per-group scales for dynamically scaled dtypes; see
    kv_cache_format). Lanes: keys and values as the layer stores them (float32, float16,
    or int8/int4 codes with static scales baked into the graph), [kv_heads, head_dim] per
    token ([kv_heads, head_dim / 2] bytes for int4).
    """
    if layout == "lanes":
        dtype = kv_sides(spec)[0].tensors()[0]["dtype"]  # the codes' dtype
        dim = spec.head_dim // 2 if spec.kv_dtype == "int4" else spec.head_dim
        return [{"name": name, "dtype": dtype, "slot_shape": [spec.num_kv_heads, dim]}
                for name in ("key", "value")]
    return [t for side in kv_sides(spec) for t in (
        [{**b, "per": "block"} for b in block_side(side, spec.kv_block_size).tensors()]
        if side.per_block else side.tensors())]


class _DecoderLowering:
    def __init__(self, ir: ModelIR, options: LoweringOptions):
        self.ir, self.arch, self.options = ir, ir.arch, options
        ops_type = OPERATOR_SETS[options.operator_set]
        self.g = GraphBuilder("llmopt_decoder", ops_type.opset)
        self.ops: StandardOps = ops_type(self.g, self.arch.norm_eps)
        self._masks: dict[int | None, str] = {}
        self._sink_masks: dict[int, str] = {}
        self._blocks: _StepBlocks | None = None  # per-block key scales: built once
        self._past_len: str | None = None  # gathered past positions M * block_size, [1]
        self._positions: str | None = None  # lanes: the step's positions, built once
        self.lanes = options.kv_layout == "lanes"

    def build(self) -> onnx.ModelProto:
        self._declare_io()
        self._rope_tables()
        hidden = self._embed()
        x = self.ops.rms_norm(hidden, self._norm("layers.0.attn_norm"))
        layer_nodes = []
        for index in range(self.arch.num_layers):
            before = len(self.g.nodes)
            x, hidden = self._layer(index, x, hidden)
            layer_nodes.append(len(self.g.nodes) - before)
        self._head(hidden)
        model = self.g.model()
        # Per-node overhead matters on a small CPU: record what each layer costs in nodes
        # (the first layer also builds the step's shared masks and rotary inputs).
        onnx.helper.set_model_props(model, {
            "llmopt.nodes_per_layer": str(max(layer_nodes[1:], default=0)),
            "llmopt.nbits_accuracy_level": str(self.options.nbits_accuracy_level),
        })
        return model

    # --- graph interface --------------------------------------------------------------
    def _declare_io(self) -> None:
        if self.lanes:
            self._declare_lane_io()
            return
        g = self.g
        g.input(C.INPUT_IDS, TensorProto.INT64, ["batch", "seq"])
        g.input(C.POSITION_IDS, TensorProto.INT64, ["batch", "seq"])
        g.input(C.BLOCK_TABLES, TensorProto.INT64, ["batch", "max_blocks"])
        g.input(C.CONTEXT_LENS, TensorProto.INT64, ["batch"])
        g.input(C.LOGITS_INDICES, TensorProto.INT64, ["num_logits"])
        for i, spec in enumerate(self.arch.layers):
            for t in cache_tensors(spec):
                elem = NP_TO_ONNX[np.dtype(t["dtype"])]
                if t.get("per") == "block":
                    g.input(C.past_name(i, t["name"]), elem, ["num_blocks", *t["slot_shape"]])
                    g.output(C.new_block_name(i, t["name"]), elem,
                             ["batch", "step_blocks", *t["slot_shape"]])
                    continue
                pool_shape = ["num_blocks", "block_size", *t["slot_shape"]]
                g.input(C.past_name(i, t["name"]), elem, pool_shape)
                g.output(C.new_name(i, t["name"]), elem, ["batch", "seq", *t["slot_shape"]])
            for t in tail_tensors(spec):
                g.input(C.tail_name(i, t["name"]), TensorProto.FLOAT,
                        ["tail_store_rows", spec.kv_block_size, *t["slot_shape"]])
                g.output(C.new_tail_name(i, t["name"]), TensorProto.FLOAT,
                         ["batch", "seq", *t["slot_shape"]])
            for t in sink_tensors(spec):
                g.input(C.sink_name(i, t["name"]), TensorProto.FLOAT,
                        ["sink_store_rows", spec.kv_sink_tokens, *t["slot_shape"]])
                g.output(C.new_sink_name(i, t["name"]), TensorProto.FLOAT,
                         ["batch", "sink_rows_written", *t["slot_shape"]])
        if any(spec.kv_sink_tokens for spec in self.arch.layers):
            g.input(C.SINK_ROWS, TensorProto.INT64, ["batch"])
        if any(tail_tensors(spec) for spec in self.arch.layers):
            g.input(C.TAIL_ROWS, TensorProto.INT64, ["batch"])
        g.output(C.LOGITS, TensorProto.FLOAT, ["num_logits", self.arch.vocab_size])

    def _declare_lane_io(self) -> None:
        g = self.g
        g.input(C.INPUT_IDS, TensorProto.INT64, ["batch", "seq"])
        g.input(C.SEQLENS_K, TensorProto.INT32, ["batch"])
        g.input(C.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [])
        g.input(C.QUERY_SEQLENS, TensorProto.INT32, ["batch"])
        g.input(C.LOGITS_INDICES, TensorProto.INT64, ["num_logits"])
        for i, spec in enumerate(self.arch.layers):
            for t in cache_tensors(spec, "lanes"):
                lane = ["batch", t["slot_shape"][0], "capacity", t["slot_shape"][1]]
                elem = NP_TO_ONNX[np.dtype(t["dtype"])]
                g.input(C.past_name(i, t["name"]), elem, lane)
                g.output(C.present_name(i, t["name"]), elem, lane)
        g.output(C.LOGITS, TensorProto.FLOAT, ["num_logits", self.arch.vocab_size])

    def _rope_tables(self) -> None:
        positions = self.options.max_position or self.arch.max_position
        for name, rope in self.arch.ropes.items():
            cos, sin = rope.tables(positions)
            self.g.weight(f"rope.{name}.cos", cos.numpy())
            self.g.weight(f"rope.{name}.sin", sin.numpy())

    # --- weights ----------------------------------------------------------------------
    def _stored(self, name: str, array: np.ndarray) -> str:
        """Initializer in the storage dtype, cast to float32 for compute when narrower."""
        dtype = WEIGHT_DTYPES[self.options.weight_dtype]
        stored = self.g.weight(name, array.astype(dtype))
        if dtype == np.float32:
            return stored
        return self.g.op("Cast", [stored], name=name + ".f32", to=TensorProto.FLOAT)

    def _norm(self, name: str) -> str:
        return self.g.weight(name, _np(self.ir.weights[name]))

    def _linear(self, x: str, prefix: str, parts: list[str]) -> str:
        """x @ concat(parts)^T (+ bias): one MatMul for fused projections (QKV, gate/up)."""
        w = self.ir.weights
        quantized = [self.ir.quantized.get(prefix + p) for p in parts]
        if all(quantized):
            out = self._quantized_matmul(x, f"{prefix}{'_'.join(parts)}", concat_outputs(quantized))
        else:  # float, or a fused group only partly quantized: its float (dequantized) weights
            weight = np.concatenate([_np(w[f"{prefix}{p}.weight"]) for p in parts], axis=0)
            out = self.g.op("MatMul", [x, self._stored(f"{prefix}{'_'.join(parts)}", weight.T)])
        if any(f"{prefix}{p}.bias" in w for p in parts):
            bias = np.concatenate([_bias(w, f"{prefix}{p}") for p in parts])
            out = self.g.op("Add", [out, self.g.weight(f"{prefix}{'_'.join(parts)}.bias", bias)])
        return out

    def _quantized_matmul(self, x: str, name: str, q: QuantizedLinear) -> str:
        """x @ wᵀ for integer weights, in the form the target's operators take."""
        if not q.integer_zeros():  # fractional zero points: symmetric codes + group offsets
            symmetric, offset = split_fractional_zeros(q)
            g, k = self.g, q.shape[1]
            sums = g.op("MatMul", [x, g.weight(f"group_sum.{k}.{q.group_size}",
                                               group_sum_matrix(k, q.group_size))])
            correction = g.op("MatMul", [sums, g.weight(f"{name}.group_offset", offset)])
            return g.op("Add", [self._quantized_matmul(x, name, symmetric), correction])
        form = self.options.quantized_matmul or self.ops.quantized_matmul
        if form == "matmul_nbits" and q.bits == 8 and self.options.nbits_accuracy_level == 0:
            # ONNX Runtime's 8-bit MatMulNBits with float activations runs ~15x slower than
            # a float32 MatMul here (measured on SmolLM2's shapes): exact float weights win.
            return self.g.op("MatMul", [x, self._stored(name, q.dequantize().numpy().T)])
        if form == "dequantize_linear":
            inputs = [self.g.weight(f"{name}.{key}", value)
                      for key, value in pack_dequantize_linear(q).items()]
            weight = self.g.op("DequantizeLinear", inputs, name=f"{name}.dq", axis=0,
                               block_size=q.group_size)
            return self.g.op("MatMul", [x, weight])
        packed = pack_matmul_nbits(q)
        inputs = [x] + [self.g.weight(f"{name}.{key}", packed[key])
                        for key in ("B", "scales", "zero_points") if key in packed]
        n, k = q.shape
        return self.g.op("MatMulNBits", inputs, name="matmul_nbits", domain=MS_DOMAIN,
                         K=k, N=n, bits=q.bits, block_size=q.group_size,
                         accuracy_level=self.options.nbits_accuracy_level)

    # --- blocks -----------------------------------------------------------------------
    def _embed(self) -> str:
        if self._embeds_head_codes():
            hidden = self._quantized_embed()
        else:
            table = self._stored("embed_tokens", _np(self.ir.weights["embed_tokens"]))
            hidden = self.g.op("Gather", [table, C.INPUT_IDS], name="embed")
        if self.arch.embedding_scale is not None:
            scale = self.g.const(self.arch.embedding_scale, np.float32)
            hidden = self.g.op("Mul", [hidden, scale])
        return hidden

    def _embeds_head_codes(self) -> bool:
        """A tied LM head quantized to integer codes makes the embedding table those codes
        dequantized (`ModelIR.set_quantized`): gather them from the codes, exactly, with no
        float32 table in the artifact or in memory."""
        q = self.ir.quantized.get("lm_head")
        return (q is not None and self.arch.tie_word_embeddings and q.integer_zeros()
                and self.ops.operator_set == "onnxruntime"
                and not q.shape[1] % q.group_size and not q.group_size & (q.group_size - 1))

    def _quantized_embed(self) -> str:
        """Embedding rows dequantized from the tied LM head's codes by ONNX Runtime's
        GatherBlockQuantized: MatMulNBits' packing, row by row, is its packing."""
        q = self.ir.quantized["lm_head"]
        packed = pack_matmul_nbits(q)
        vocab = q.shape[0]
        inputs = [self.g.weight("embed_tokens.codes", packed["B"].reshape(vocab, -1)),
                  C.INPUT_IDS, self.g.weight("embed_tokens.scales", packed["scales"])]
        if "zero_points" in packed:
            inputs.append(self.g.weight("embed_tokens.zero_points", packed["zero_points"]))
        return self.g.op("GatherBlockQuantized", inputs, name="embed", domain=MS_DOMAIN,
                         bits=q.bits, block_size=q.group_size, gather_axis=0,
                         quantize_axis=1)

    def _layer(self, index: int, x: str, hidden: str) -> tuple[str, str]:
        """One decoder layer; returns (next layer's normed input, residual stream)."""
        p = f"layers.{index}."
        attn = self._attention(index, x)
        if self.arch.sandwich_norm:
            attn = self.ops.rms_norm(attn, self._norm(p + "post_attn_norm"))
        x, hidden = self.ops.add_rms_norm(attn, hidden, self._norm(p + "mlp_norm"))
        mlp = self._mlp(p, x)
        if self.arch.sandwich_norm:
            mlp = self.ops.rms_norm(mlp, self._norm(p + "post_mlp_norm"))
        if index + 1 < self.arch.num_layers:
            return self.ops.add_rms_norm(mlp, hidden, self._norm(f"layers.{index + 1}.attn_norm"))
        return "", self.g.op("Add", [hidden, mlp], name="residual")

    def _mlp(self, p: str, x: str) -> str:
        g, size = self.g, self.arch.intermediate_size
        gate, up = g.op("Split", [self._linear(x, p, ["gate_proj", "up_proj"]),
                                  g.const([size, size])], axis=-1, outputs=2)
        if self.arch.activation == "silu":
            act = g.op("Mul", [gate, g.op("Sigmoid", [gate])], name="silu")
        else:
            act = g.op("Gelu", [gate], name="gelu", approximate="tanh")
        return self._linear(g.op("Mul", [act, up]), p, ["down_proj"])

    def _attention(self, index: int, x: str) -> str:
        g, spec, p = self.g, self.arch.layers[index], f"layers.{index}."
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = self._linear(x, p, ["q_proj", "k_proj", "v_proj"])
        if self.lanes:
            return self._linear(self._lane_attention(index, qkv), p, ["o_proj"])
        q, k, v = g.op("Split", [qkv, g.const([heads * dim, kv_heads * dim, kv_heads * dim])],
                       axis=-1, outputs=3)
        if self.arch.qk_norm:
            q = self._head_norm(q, heads, dim, p + "q_norm")
            k = self._head_norm(k, kv_heads, dim, p + "k_norm")
        table = f"rope.{spec.rope}"
        q = self.ops.rotary(q, heads, dim, table, C.POSITION_IDS)
        k = self.ops.rotary(k, kv_heads, dim, table, C.POSITION_IDS)
        if spec.kv_rotate_keys:  # q·k is unchanged; the cache stores rotated keys
            q = emit_rotate_heads(g, q, heads, dim)
            k = emit_rotate_heads(g, k, kv_heads, dim)
        if kv_sides(spec)[0].per_block:
            keys, values, mask = self._block_scaled_kv(index, k, v, spec)
        else:
            keys = self._cache_io(index, "key", k, spec)
            values = self._cache_io(index, "value", v, spec)
            mask = self._mask(spec.sliding_window)
        half = half_precision_attention(spec)
        if half:  # the queries and the output in float16, as the lanes' node has them
            q = self._round_to_float16(q)
        out = self.ops.attention(q, keys, values, mask, spec, self.arch.attn_scale,
                                 self.arch.attn_softcap)
        if half:
            out = self._round_to_float16(out)
        return self._linear(out, p, ["o_proj"])

    def _round_to_float16(self, x: str) -> str:
        g = self.g
        return g.op("Cast", [g.op("Cast", [x], to=TensorProto.FLOAT16)], to=TensorProto.FLOAT)

    def _lane_attention(self, index: int, qkv: str) -> str:
        """One GroupQueryAttention node: qk-norm and RoPE, the step's valid keys and values
        appended to each row's lane in place, attention over the lane's first
        seqlens_k + 1 entries (`query_seqlens` marks right padding and idle rows).

        A layer stored rounded must attend to its step's keys and values as the lane holds
        them (a token's key then does not depend on which step computed it, and the
        reference model is matched): RoPE, the key rotation and the storage rounding run
        before the node, whose own quantization of the rounded values is then exact. A
        float16 layer's node runs on float16 queries, keys and values and returns float16,
        as every layout's float16 attention does (`half_precision_attention`)."""
        g, spec, p = self.g, self.arch.layers[index], f"layers.{index}."
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        table = f"rope.{spec.rope}"
        rounded = spec.kv_dtype != "float32"  # stored rounded: RoPE before the node
        half = half_precision_attention(spec)  # else int8/int4, static per-channel scales
        coded = rounded and not half
        scales = [self._lane_kv_scale(index, s) for s in kv_sides(spec)] if coded else []
        qkv_inputs, rotary = [qkv, "", ""], [f"{table}.cos", f"{table}.sin"]  # packed
        if self.arch.qk_norm or rounded:
            q, k, v = g.op("Split", [qkv, g.const([heads * dim, kv_heads * dim,
                                                   kv_heads * dim])], axis=-1, outputs=3)
            if self.arch.qk_norm:  # (ONNX Runtime's CPU kernel does not fuse the norms)
                q = self._head_norm(q, heads, dim, p + "q_norm")
                k = self._head_norm(k, kv_heads, dim, p + "k_norm")
            qkv_inputs = [q, k, v]
        if rounded:
            positions = self._lane_positions()
            q = self.ops.rotary(q, heads, dim, table, positions)
            k = self.ops.rotary(k, kv_heads, dim, table, positions)
            if spec.kv_rotate_keys:  # the lane stores rotated keys; q·k is unchanged
                q, k = emit_rotate_heads(g, q, heads, dim), emit_rotate_heads(g, k, kv_heads, dim)
            if coded:
                k, v = (emit_round_trip(g, x, side, scale)
                        for x, side, scale in zip((k, v), kv_sides(spec), scales, strict=True))
            else:  # the whole node runs on float16 inputs (sums in float32)
                q, k, v = (g.op("Cast", [x], to=TensorProto.FLOAT16) for x in (q, k, v))
            qkv_inputs, rotary = [q, k, v], ["", ""]
        attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": self.arch.attn_scale,
                 "do_rotary": int(not rounded), "rotary_interleaved": 0}
        if self.arch.attn_softcap:
            attrs["softcap"] = self.arch.attn_softcap
        if spec.sliding_window is not None:  # keys at distance < window, as `_in_window`
            attrs["local_window_size"] = spec.sliding_window
        if coded:
            attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                         kv_cache_bit_width=8 if spec.kv_dtype == "int8" else 4)
        out = g.fresh("attention")
        inputs = [*qkv_inputs, C.past_name(index, "key"), C.past_name(index, "value"),
                  C.SEQLENS_K, C.TOTAL_SEQUENCE_LENGTH, *rotary,
                  "", "", "",  # position_ids, attention_bias, head_sink
                  *(scales or ["", ""]), "", "",  # q/k norm weights (not fused on CPU)
                  C.QUERY_SEQLENS]
        g.op_into("GroupQueryAttention", inputs,
                  [out, C.present_name(index, "key"), C.present_name(index, "value")],
                  domain=MS_DOMAIN, **attrs)
        return g.op("Cast", [out], to=TensorProto.FLOAT) if half else out

    def _lane_positions(self) -> str:
        """Row s of sequence b is at position seqlens_k[b] + 1 - query_seqlens[b] + s, as
        GroupQueryAttention counts (padding rows clamped into the rotary tables), [B, S]."""
        if self._positions is None:
            g = self.g
            start = g.op("Sub", [g.op("Add", [C.SEQLENS_K, g.const(1, np.int32)]),
                                 C.QUERY_SEQLENS])
            start = g.op("Unsqueeze", [g.op("Cast", [start], to=TensorProto.INT64),
                                       g.const([1])])
            length = g.op("Gather", [g.op("Shape", [C.INPUT_IDS]), g.const(1)], axis=0)
            rows = g.op("Range", [g.const(0), length, g.const(1)])
            last = (self.options.max_position or self.arch.max_position) - 1
            self._positions = g.op("Min", [g.op("Add", [start, rows]), g.const(last)],
                                   name="lane_positions")
        return self._positions

    def _lane_kv_scale(self, index: int, side: KVSide) -> str:
        """A static per-channel KV scale, [kv_heads * head_dim], for GroupQueryAttention."""
        name = f"layers.{index}.{side.static_scale_weight}"
        return self.g.weight(name, _np(self.ir.weights[name]).reshape(-1))

    def _head_norm(self, x: str, heads: int, dim: int, weight: str) -> str:
        g = self.g
        per_head = g.op("Reshape", [x, g.const([0, 0, heads, dim])])
        normed = self.ops.rms_norm(per_head, self._norm(weight))
        return g.op("Reshape", [normed, g.const([0, 0, heads * dim])])

    def _cache_io(self, index: int, tensor: str, new: str, spec: LayerSpec) -> str:
        """Store the step's keys or values (new [B, S, kv_heads*D]) as the `new.{i}.*`
        outputs; return what attention reads, past + new, float32 [B, L, kv_heads * D].

        The step's own entries are read back through the same storage round trip as the
        past ones, so a token's key is the same whichever step computes its query.
        """
        side = kv_sides(spec)[0 if tensor == "key" else 1]
        static = self._static_kv_scale(index, side)
        stored = emit_encode(self.g, new, side, static)
        combined = {}
        for t in side.tensors():
            name = t["name"]
            value = self.g.rename(stored[name], C.new_name(index, name))
            past = self._gathered(index, name, t["slot_shape"])
            combined[name] = self.g.op("Concat", [past, value], axis=1, name=f"{name}s")
        read = emit_decode(self.g, combined, side, static)
        if spec.kv_sink_tokens:
            return self._with_sinks(index, tensor, new, read, spec.kv_sink_tokens)
        return read

    def _with_sinks(self, index: int, tensor: str, new: str, read: str, sinks: int) -> str:
        """`read` [B, Lp + S, W] (past blocks, then the step's rows) with positions < sinks
        unrounded: past ones from the sink store, the step's own as computed (`new`), which
        the step also returns for the store."""
        g = self.g
        g.rename(g.op("Slice", [new, g.const([0]), g.const([sinks]), g.const([1])]),
                 C.new_sink_name(index, tensor))
        stored = g.op("Gather", [C.sink_name(index, tensor), C.SINK_ROWS], axis=0)  # [B, N, W]
        is_sink, past_len = self._sink_mask(sinks), self._past_length()
        pads = g.op("Concat", [g.const([0, 0, 0, 0]), past_len, g.const([0])], axis=0)
        past = g.op("Slice", [g.op("Pad", [stored, pads]), g.const([0]), past_len,
                              g.const([1])])  # [B, Lp, W]: rows >= N are never read
        unrounded = g.op("Concat", [past, new], axis=1)
        return g.op("Where", [is_sink, unrounded, read], name=f"{tensor}s_with_sinks")

    def _sink_mask(self, sinks: int) -> str:
        """Which of the keys attention reads are sink positions, [B, Lp + S, 1]; built once
        per step."""
        if sinks not in self._sink_masks:
            g = self.g
            past_len = self._past_length()
            past_pos = g.op("Range", [g.const(0), g.op("Squeeze", [past_len]), g.const(1)])
            batch = g.op("Shape", [C.POSITION_IDS], start=0, end=1)
            past_pos = g.op("Expand", [past_pos, g.op("Concat", [batch, past_len], axis=0)])
            positions = g.op("Concat", [past_pos, C.POSITION_IDS], axis=1)  # [B, Lp + S]
            is_sink = g.op("Less", [g.op("Unsqueeze", [positions, g.const([2])]),
                                    g.const(sinks)], name="is_sink")
            self._sink_masks[sinks] = is_sink
        return self._sink_masks[sinks]

    def _block_scaled_kv(self, index: int, k: str, v: str, spec: LayerSpec
                         ) -> tuple[str, str, str]:
        """Keys scaled per channel per block: (keys, values, mask) laid out as
        [complete past blocks | the step's blocks read back | the step's blocks unrounded].

        The step's blocks run from the one holding context_lens[b] on: the tail store's
        rows of it, then the step's keys (`_StepBlocks`). A query sees past blocks and
        earlier step blocks through their scales, its own block unrounded (the mask picks
        one copy of each key); values are stored per token as usual."""
        g, bs = self.g, spec.kv_block_size
        side = kv_sides(spec)[0]
        step = self._step_blocks(bs)
        g.rename(g.op("Identity", [k]), C.new_tail_name(index, "key"))
        tail = g.op("Gather", [C.tail_name(index, "key"), C.TAIL_ROWS], axis=0)  # [B, bs, W]
        unrounded = step.aligned(g.op("Concat", [tail, k], axis=1), step.key_index)
        stored = {name: g.rename(value, C.new_block_name(index, name))
                  for name, value in emit_block_encode(g, unrounded, side, bs).items()}
        read = emit_block_decode(g, stored, side, bs)
        past = emit_block_decode(g, {name: g.op("Gather", [C.past_name(index, name),
                                                            C.BLOCK_TABLES], axis=0)
                                     for name in stored}, side, bs)  # [B, M * bs, W]
        keys = g.op("Concat", [past, read, unrounded], axis=1, name="block_keys")
        values = self._cache_io(index, "value", v, spec)  # [B, M * bs + S, W]
        step_values = step.aligned(values, step.value_index)
        past_values = g.op("Slice", [values, g.const([0]), step.past_len, g.const([1])])
        values = g.op("Concat", [past_values, step_values, step_values], axis=1)
        return keys, values, step.mask(spec.sliding_window)

    def _step_blocks(self, block_size: int) -> _StepBlocks:
        if self._blocks is None:
            self._blocks = _StepBlocks(self.g, block_size, self._past_length())
        return self._blocks

    def _gathered(self, index: int, name: str, slot_shape: list[int]) -> str:
        """Pool tensor `name` of layer `index` at the step's block tables, [B, M*bs, slot]."""
        g = self.g
        blocks = g.op("Gather", [C.past_name(index, name), C.BLOCK_TABLES], axis=0)
        return g.op("Reshape", [blocks, g.const([0, -1, *slot_shape])])

    def _static_kv_scale(self, index: int, side: KVSide) -> str | None:
        if not side.quantized or side.dynamic:
            return None
        name = f"layers.{index}.{side.static_scale_weight}"
        return static_scale_initializer(self.g, name, self.ir.weights[name], side)

    def _past_length(self) -> str:
        """Positions the step's gathered blocks hold, M * block_size, [1]; built once.
        (From the values' pool: one entry per slot in every layer; keys may be per block.)"""
        if self._past_len is None:
            g = self.g
            block_size = g.op("Shape", [C.past_name(0, "value")], start=1, end=2)
            self._past_len = g.op("Mul", [g.op("Shape", [C.BLOCK_TABLES], start=1, end=2),
                                          block_size], name="past_len")
        return self._past_len

    def _mask(self, window: int | None) -> str:
        """Additive mask [B, 1, S, L], built once per window size and shared by layers."""
        if window not in self._masks:
            g = self.g
            allowed = _AllowedKeys(g, self._past_length()).build(window)
            bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(_NEG_INF, np.float32)])
            self._masks[window] = g.op("Unsqueeze", [bias, g.const([1])], name="mask")
        return self._masks[window]

    def _head(self, hidden: str) -> None:
        g = self.g
        flat = g.op("Reshape", [hidden, g.const([-1, self.arch.hidden_size])])
        rows = g.op("Gather", [flat, C.LOGITS_INDICES], axis=0)
        normed = self.ops.rms_norm(rows, self._norm("final_norm"))
        if "lm_head" in self.ir.quantized:
            logits = self._quantized_matmul(normed, "lm_head", self.ir.quantized["lm_head"])
        elif self.arch.tie_word_embeddings:  # share the embedding table: [vocab, hidden]
            table = self._stored("embed_tokens", _np(self.ir.weights["embed_tokens"]))
            logits = g.op("Gemm", [normed, table], transB=1, name="lm_head")
        else:
            head = self._stored("lm_head", _np(self.ir.weights["lm_head.weight"]).T)
            logits = g.op("MatMul", [normed, head], name="lm_head")
        if self.arch.final_softcap:
            cap = g.const(self.arch.final_softcap, np.float32)
            logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
        g.op_into("Identity", [logits], [C.LOGITS])


class _AllowedKeys:
    """Which keys each query may see, [B, S, L] bool, L = gathered past + step tokens.

    Past key p (its position, since blocks hold a sequence in order) is visible when
    p < context_len and inside the window; the step's key j is visible to query i when
    j <= i (index causality, so right padding never leaks) and inside the window.
    """

    def __init__(self, g: GraphBuilder, past_len: str):
        self.g, self.past_len = g, past_len

    def build(self, window: int | None) -> str:
        g = self.g
        q_pos = g.op("Unsqueeze", [C.POSITION_IDS, g.const([2])])  # [B, S, 1]
        past = self._past(q_pos, window)
        new = self._new(q_pos, window)
        return g.op("Concat", [past, new], axis=2, name="allowed")

    def _past(self, q_pos: str, window: int | None) -> str:
        g = self.g
        length = g.op("Squeeze", [self.past_len])
        k_pos = g.op("Range", [g.const(0), length, g.const(1)])  # [Lp]
        ctx = g.op("Unsqueeze", [C.CONTEXT_LENS, g.const([1, 2])])  # [B, 1, 1]
        allowed = g.op("Less", [k_pos, ctx])  # [B, 1, Lp]
        if window is not None:
            allowed = g.op("And", [allowed, self._in_window(q_pos, k_pos, window)])
        return self._expand(allowed, q_pos, length)

    def _new(self, q_pos: str, window: int | None) -> str:
        g = self.g
        seq = g.op("Squeeze", [g.op("Shape", [C.INPUT_IDS], start=1, end=2)])
        index = g.op("Range", [g.const(0), seq, g.const(1)])
        causal = g.op("LessOrEqual", [index, g.op("Unsqueeze", [index, g.const([1])])])  # [S, S]
        if window is not None:
            k_pos = g.op("Unsqueeze", [C.POSITION_IDS, g.const([1])])  # [B, 1, S]
            causal = g.op("And", [causal, self._in_window(q_pos, k_pos, window)])
        return self._expand(causal, q_pos, seq)

    def _in_window(self, q_pos: str, k_pos: str, window: int) -> str:
        distance = self.g.op("Sub", [q_pos, k_pos])
        return self.g.op("Less", [distance, self.g.const(window)])

    def _expand(self, mask: str, q_pos: str, length: str) -> str:
        """Broadcast to [B, S, length] so the two halves concatenate."""
        g = self.g
        batch_seq = g.op("Shape", [C.POSITION_IDS])
        shape = g.op("Concat", [batch_seq, g.op("Unsqueeze", [length, g.const([0])])], axis=0)
        return g.op("Expand", [mask, shape])


class _StepBlocks:
    """Where a step's blocks come from, and what each query sees, for per-block key scales.

    Sequence b continues block c_b = context_lens[b] // bs, of which t_b = context_lens[b]
    % bs rows are in the tail store. The step's blocks are A = ceil((max t + S) / bs) * bs
    positions from c_b * bs: row a is the tail's row a (a < t_b) or the step's row a - t_b.
    Keys are laid out [past M * bs | step blocks read back (A) | step blocks unrounded (A)].
    """

    def __init__(self, g: GraphBuilder, block_size: int, past_len: str):
        self.g, self.bs, self.past_len = g, block_size, past_len
        bs = g.const(block_size)
        ctx = C.CONTEXT_LENS
        self.t = g.op("Mod", [ctx, bs])  # [B] rows of the continued block in the tail
        self.start = g.op("Sub", [ctx, self.t])  # [B] its first position
        self.seq = g.op("Shape", [C.INPUT_IDS], start=1, end=2)  # [1]
        rows = g.op("Add", [g.op("ReduceMax", [self.t], keepdims=1), self.seq])
        blocks = g.op("Div", [g.op("Add", [rows, g.const([block_size - 1])]), bs])
        self.length = g.op("Mul", [blocks, bs])  # [1] A
        a = g.op("Range", [g.const(0), g.op("Squeeze", [self.length]), g.const(1)])
        self.a = g.op("Unsqueeze", [a, g.const([0])])  # [1, A]
        t = g.op("Unsqueeze", [self.t, g.const([1])])  # [B, 1]
        in_tail = g.op("Less", [self.a, t])  # [B, A]
        from_step = g.op("Sub", [self.a, t])  # the step's row, where not in the tail
        self.key_index = self._rows(g.op("Where", [in_tail, self.a, g.op("Add", [
            from_step, bs])]), g.op("Add", [self.seq, bs]))  # into [tail (bs) | step (S)]
        start = g.op("Unsqueeze", [self.start, g.const([1])])
        self.value_index = self._rows(g.op("Where", [in_tail, g.op("Add", [start, self.a]),
                                                     g.op("Add", [from_step, self.past_len])]),
                                      g.op("Add", [self.past_len, self.seq]))
        self._masks: dict[int | None, str] = {}

    def _rows(self, index: str, length: str) -> str:
        """[B, A] row indices clipped into [0, length) as GatherND's [B, A, 1]."""
        g = self.g
        last = g.op("Sub", [length, g.const([1])])
        clipped = g.op("Min", [g.op("Max", [index, g.const(0)]), last])
        return g.op("Unsqueeze", [clipped, g.const([2])])

    def aligned(self, x: str, index: str) -> str:
        """x [B, L, W] gathered into the step's blocks, [B, A, W]."""
        return self.g.op("GatherND", [x, index], batch_dims=1)

    def mask(self, window: int | None) -> str:
        """Additive [B, 1, S, M * bs + 2A], built once per window size."""
        if window not in self._masks:
            g = self.g
            q_pos = g.op("Unsqueeze", [C.POSITION_IDS, g.const([2])])  # [B, S, 1]
            start = g.op("Unsqueeze", [self.start, g.const([1, 2])])  # [B, 1, 1]
            past_len = g.op("Squeeze", [self.past_len])
            k_pos = g.op("Range", [g.const(0), past_len, g.const(1)])  # [Lp]
            past = g.op("Less", [k_pos, start])  # complete blocks before the step's
            a_pos = g.op("Add", [start, g.op("Unsqueeze", [self.a, g.const([0])])])  # [B,1,A]
            causal = g.op("LessOrEqual", [a_pos, q_pos])  # [B, S, A]
            block = g.const(self.bs)
            earlier = g.op("Less", [g.op("Div", [a_pos, block]), g.op("Div", [q_pos, block])])
            read = g.op("And", [causal, earlier])
            unrounded = g.op("And", [causal, g.op("Not", [earlier])])
            if window is not None:
                past = g.op("And", [past, self._in_window(q_pos, k_pos, window)])
                in_window = self._in_window(q_pos, a_pos, window)
                read = g.op("And", [read, in_window])
                unrounded = g.op("And", [unrounded, in_window])
            shape = g.op("Concat", [g.op("Shape", [C.POSITION_IDS]), self.past_len], axis=0)
            allowed = g.op("Concat", [g.op("Expand", [past, shape]), read, unrounded], axis=2)
            bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(_NEG_INF, np.float32)])
            self._masks[window] = g.op("Unsqueeze", [bias, g.const([1])], name="block_mask")
        return self._masks[window]

    def _in_window(self, q_pos: str, k_pos: str, window: int) -> str:
        return self.g.op("Less", [self.g.op("Sub", [q_pos, k_pos]), self.g.const(window)])


def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).numpy()


def _bias(weights: dict[str, torch.Tensor], prefix: str) -> np.ndarray:
    if f"{prefix}.bias" in weights:
        return _np(weights[f"{prefix}.bias"])
    return np.zeros(weights[f"{prefix}.weight"].shape[0], dtype=np.float32)
