"""Lower ModelIR once to an ONNX decoder graph with the paged-KV contract, returning what
the artifact writer and the draft's measurement need of it (`LoweredGraph`).

See `llmopt.runtime.contract` for the inputs and outputs. Blocks layout: attention gathers
only the blocks named in the block tables, concatenates the step's own keys/values, and
masks by context length, causality and sliding window (`masks`; each mask is built once
per step and shared by every layer with the same window). Lanes layout: one
GroupQueryAttention node per layer reads and appends each sequence's lane in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from onnx import TensorProto

from llmopt.compiler.attention_sums import emit_attention_sums
from llmopt.compiler.ir import ArchSpec, LayerSpec, ModelIR
from llmopt.compiler.kv_cache_format import (
    KVSide,
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
from llmopt.compiler.kv_layout import (
    cache_tensors,
    kv_cache_spec,
    kv_layout_for,
    reads_local_table,
    sink_tensors,
    tail_tensors,
)
from llmopt.compiler.lower_ops import OPERATOR_SETS, StandardOps
from llmopt.compiler.masks import StepBlocks, additive_mask, sink_mask
from llmopt.compiler.native_plan import (
    BNB4_CODEBOOKS,
    AttentionShape,
    LaneNames,
    MatrixNames,
    PlanRecorder,
)
from llmopt.compiler.nf4 import bnb_quant_type, codebook_matmul
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
from llmopt.runtime.manifest import KVCacheSpec

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe

WEIGHT_DTYPES = {"float32": np.float32, "float16": np.float16}
_FLOAT_PROJECTIONS = "float projections (MatMul): the native step multiplies int4/int8 codes"


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
    # Lanes: also return each layer's step attention weights summed per KV head (H2O on
    # ONNX Runtime, whose fused attention returns none: compiler/attention_sums.py).
    attention_sums: bool = False


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
        attention_sums=recipe.runtime.h2o is not None,
    )


@dataclass(frozen=True)
class LoweredGraph:
    """A model lowered once: its graph, the options it was lowered with, and what the
    manifest records of it."""

    model: onnx.ModelProto
    options: LoweringOptions
    kv_cache: KVCacheSpec  # the manifest's `kv_cache` section for `options.kv_layout`
    nodes_per_layer: int  # the most nodes a layer past the first takes
    native: PlanRecorder  # the native step's plan, resolved once the graph is saved


def lower(ir: ModelIR, recipe: Recipe, data_file: Path | None = None) -> LoweredGraph:
    """Lower a model (the target, or its draft) as the recipe's target asks; with
    `data_file`, weights stream into it layer by layer instead of staying in the graph."""
    options = lowering_options(recipe, ir.arch)
    lowering = _DecoderLowering(ir, options, data_file)
    model = lowering.build()
    kv_cache = KVCacheSpec.model_validate(kv_cache_spec(ir.arch, options.kv_layout))
    return LoweredGraph(model, options, kv_cache, lowering.nodes_per_layer, lowering.native)


def lower_to_onnx(ir: ModelIR, options: LoweringOptions) -> onnx.ModelProto:
    return _DecoderLowering(ir, options).build()


class _DecoderLowering:
    def __init__(self, ir: ModelIR, options: LoweringOptions, data_file: Path | None = None):
        self.ir, self.arch, self.options = ir, ir.arch, options
        ops_type = OPERATOR_SETS[options.operator_set]
        self.g = GraphBuilder("llmopt_decoder", ops_type.opset, data_file)
        self.ops: StandardOps = ops_type(self.g, self.arch.norm_eps)
        self._masks: dict[int | None, str] = {}
        self._sink_masks: dict[int, str] = {}
        self._blocks: StepBlocks | None = None  # per-block key scales: built once
        self._past_len: str | None = None  # gathered past positions M * block_size, [1]
        self._positions: str | None = None  # lanes: the step's positions, built once
        self.lanes = options.kv_layout == "lanes"
        self.nodes_per_layer = 0  # set by build()
        # Each emitter records what the native step needs of its nodes, or why it cannot.
        self.native = PlanRecorder(ir.arch)
        if not self.lanes:
            self.native.unsupported("not a lanes graph (no GroupQueryAttention)")

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
        self.nodes_per_layer = max(layer_nodes[1:], default=0)
        onnx.helper.set_model_props(model, {
            "llmopt.nodes_per_layer": str(self.nodes_per_layer),
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
        if any(reads_local_table(spec, "blocks") for spec in self.arch.layers):
            g.input(C.LOCAL_BLOCK_TABLES, TensorProto.INT64, ["batch", "max_blocks"])
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
        stored = self.g.weight(name, array.astype(dtype, copy=False))
        if dtype == np.float32:
            return stored
        return self.g.op("Cast", [stored], name=name + ".f32", to=TensorProto.FLOAT)

    def _norm(self, name: str) -> str:
        return self.g.weight(name, _np(self.ir.weights[name]))

    def _linear(self, x: str, prefix: str, parts: list[str]) -> str:
        """x @ concat(parts)^T (+ bias): one MatMul for fused projections (QKV, gate/up)."""
        w = self.ir.weights
        quantized = [self.ir.quantized.get(prefix + p) for p in parts]
        fused = f"{prefix}{'_'.join(parts)}"
        if all(quantized):
            out = self._quantized_matmul(x, fused, concat_outputs(quantized))
        else:  # float, or a fused group only partly quantized: its float (dequantized) weights
            weight = np.concatenate([_np(w[f"{prefix}{p}.weight"]) for p in parts], axis=0)
            out = self.g.op("MatMul", [x, self._stored(fused, weight.T)])
            self.native.unsupported(_FLOAT_PROJECTIONS)
        if any(f"{prefix}{p}.bias" in w for p in parts):
            bias = np.concatenate([_bias(w, f"{prefix}{p}") for p in parts])
            out = self.g.op("Add", [out, self.g.weight(f"{fused}.bias", bias)])
            self.native.bias(fused, f"{fused}.bias")
        return out

    def _quantized_matmul(self, x: str, name: str, q: QuantizedLinear) -> str:
        """x @ wᵀ for integer weights, in the form the target's operators take."""
        n, k = q.shape
        if q.codebook is not None:  # NF4 / FP4
            self._record_codebook(name, q)
            return codebook_matmul(self.g, self.ops.operator_set, x, name, q)
        if not q.integer_zeros():  # fractional zero points: symmetric codes + group offsets
            symmetric, offset = split_fractional_zeros(q)
            g = self.g
            sums = g.op("MatMul", [x, g.weight(f"group_sum.{k}.{q.group_size}",
                                               group_sum_matrix(k, q.group_size))])
            correction = g.op("MatMul", [sums, g.weight(f"{name}.group_offset", offset)])
            self.native.group_offsets(name, f"{name}.group_offset")
            return g.op("Add", [self._quantized_matmul(x, name, symmetric), correction])
        form = self.options.quantized_matmul or self.ops.quantized_matmul
        if form == "matmul_nbits" and q.bits == 8 and self.options.nbits_accuracy_level == 0:
            # ONNX Runtime's 8-bit MatMulNBits with float activations is much slower than
            # a float32 MatMul: exact float weights win.
            self.native.unsupported(_FLOAT_PROJECTIONS)
            return self.g.op("MatMul", [x, self._stored(name, q.dequantize().numpy().T)])
        if form == "dequantize_linear":
            inputs = [self.g.weight(f"{name}.{key}", value)
                      for key, value in pack_dequantize_linear(q).items()]
            weight = self.g.op("DequantizeLinear", inputs, name=f"{name}.dq", axis=0,
                               block_size=q.group_size)
            self.native.unsupported(_FLOAT_PROJECTIONS)
            return self.g.op("MatMul", [x, weight])
        packed = pack_matmul_nbits(q)
        inputs = [x] + [self.g.weight(f"{name}.{key}", packed[key])
                        for key in ("B", "scales", "zero_points") if key in packed]
        self._record_activations()
        self.native.projection(name, MatrixNames(
            f"{name}.B", f"{name}.scales", inputs[3] if len(inputs) > 3 else None, q.bits,
            q.group_size, n, k))
        return self.g.op("MatMulNBits", inputs, name="matmul_nbits", domain=MS_DOMAIN,
                         K=k, N=n, bits=q.bits, block_size=q.group_size,
                         accuracy_level=self.options.nbits_accuracy_level)

    def _record_codebook(self, name: str, q: QuantizedLinear) -> None:
        """What codebook_matmul emits: MatMulBnb4 (the native step's too) or a float MatMul."""
        quant_type = bnb_quant_type(q.codebook)
        if self.ops.operator_set != "onnxruntime" or quant_type is None:
            self.native.unsupported(_FLOAT_PROJECTIONS)
            return
        self._record_activations()
        n, k = q.shape
        self.native.projection(name, MatrixNames(
            f"{name}.B", f"{name}.absmax", None, 4, q.group_size, n, k,
            codebook=BNB4_CODEBOOKS[quant_type]))

    def _record_activations(self) -> None:
        if self.options.nbits_accuracy_level != 4:
            self.native.unsupported("float activations (nbits_accuracy_level 0): the native "
                                    "step multiplies int8 activations")

    # --- blocks -----------------------------------------------------------------------
    def _embed(self) -> str:
        if self._embeds_head_codes():
            hidden = self._quantized_embed()
        else:
            table = self._stored("embed_tokens", _np(self.ir.weights["embed_tokens"]))
            hidden = self.g.op("Gather", [table, C.INPUT_IDS], name="embed")
            self.native.embed = table
            if table != "embed_tokens":
                self.native.unsupported("a float16 embedding table (the native step reads "
                                        "float32 rows)")
        if self.arch.embedding_scale is not None:
            scale = self.g.const(self.arch.embedding_scale, np.float32)
            hidden = self.g.op("Mul", [hidden, scale])
            self.native.unsupported("scaled embeddings")
        return hidden

    def _embeds_head_codes(self) -> bool:
        """A tied LM head quantized to integer codes makes the embedding table those codes
        dequantized (`ModelIR.set_quantized`): gather them from the codes, exactly, with no
        float32 table in the artifact or in memory."""
        q = self.ir.quantized.get("lm_head")
        return (q is not None and self.arch.tie_word_embeddings and q.integer_zeros()
                and q.codebook is None
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
        self.native.embed = MatrixNames(inputs[0], inputs[2], inputs[3] if len(inputs) > 3
                                        else None, q.bits, q.group_size, vocab, q.shape[1])
        if q.group_size not in (32, 64, 128):
            self.native.unsupported("a quantized embedding in blocks other than 32, 64 or 128")
        return self.g.op("GatherBlockQuantized", inputs, name="embed", domain=MS_DOMAIN,
                         bits=q.bits, block_size=q.group_size, gather_axis=0,
                         quantize_axis=1)

    def _layer(self, index: int, x: str, hidden: str) -> tuple[str, str]:
        """One decoder layer; returns (next layer's normed input, residual stream)."""
        p = f"layers.{index}."
        attn = self._attention(index, x)
        if self.arch.sandwich_norm:
            self.native.unsupported("norms after attention and after the MLP")
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
            self.native.unsupported("a GELU MLP")
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
        rotated = None  # the queries as the node's scores see them, where emitted
        if rounded:
            positions = self._lane_positions()
            q = self.ops.rotary(q, heads, dim, table, positions)
            k = self.ops.rotary(k, kv_heads, dim, table, positions)
            if spec.kv_rotate_keys:  # the lane stores rotated keys; q·k is unchanged
                q, k = emit_rotate_heads(g, q, heads, dim), emit_rotate_heads(g, k, kv_heads, dim)
            rotated = q
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
        self._record_lane_attention(index, scales if coded else None, half)
        out = g.fresh("attention")
        inputs = [*qkv_inputs, C.past_name(index, "key"), C.past_name(index, "value"),
                  C.SEQLENS_K, C.TOTAL_SEQUENCE_LENGTH, *rotary,
                  "", "", "",  # position_ids, attention_bias, head_sink
                  *(scales or ["", ""]), "", "",  # q/k norm weights (not fused on CPU)
                  C.QUERY_SEQLENS]
        g.op_into("GroupQueryAttention", inputs,
                  [out, C.present_name(index, "key"), C.present_name(index, "value")],
                  domain=MS_DOMAIN, **attrs)
        if self.options.attention_sums:
            self._attention_sums(index, rotated or self._rotated_queries(index, qkv_inputs),
                                 scales[0] if scales else None)
        return g.op("Cast", [out], to=TensorProto.FLOAT) if half else out

    def _rotated_queries(self, index: int, qkv_inputs: list[str]) -> str:
        """The queries rotary turns inside a node that rotates them itself (do_rotary)."""
        g, spec = self.g, self.arch.layers[index]
        q = qkv_inputs[0]
        if qkv_inputs[1] == "":  # packed q/k/v: the queries lead
            q = g.op("Slice", [q, g.const([0]), g.const([spec.num_heads * spec.head_dim]),
                               g.const([-1])])
        return self.ops.rotary(q, spec.num_heads, spec.head_dim, f"rope.{spec.rope}",
                               self._lane_positions())

    def _attention_sums(self, index: int, queries: str, key_scale: str | None) -> None:
        """H2O's step attention weights per KV head beside the fused node (see
        compiler/attention_sums.py); the native step computes its own."""
        emit_attention_sums(self.g, queries, C.present_name(index, "key"),
                            self._lane_positions(), self.arch.layers[index], index,
                            self.arch.attn_scale, self.arch.attn_softcap, key_scale)

    def _record_lane_attention(self, index: int, scales: list[str] | None, half: bool) -> None:
        """A layer's attention shape and lanes, as `_lane_attention` emitted them."""
        spec, native = self.arch.layers[index], self.native
        native.attention[index] = AttentionShape(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, self.arch.attn_scale,
            f"rope.{spec.rope}", spec.sliding_window)
        if self.arch.attn_softcap:
            native.unsupported("softcaps")
        if self.arch.qk_norm:
            native.head_norms.add(index)
        rotation = f"hadamard_{spec.head_dim}" if spec.kv_rotate_keys else None
        if half:
            native.lanes[index] = LaneNames(16, rotation=rotation)
        elif scales:
            native.lanes[index] = LaneNames(8 if spec.kv_dtype == "int8" else 4, *scales,
                                            rotation=rotation)

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
        """Which of the keys attention reads are sink positions; built once per step."""
        if sinks not in self._sink_masks:
            self._sink_masks[sinks] = sink_mask(self.g, self._past_length(), sinks)
        return self._sink_masks[sinks]

    def _block_scaled_kv(self, index: int, k: str, v: str, spec: LayerSpec
                         ) -> tuple[str, str, str]:
        """Keys scaled per channel per block: (keys, values, mask) laid out as
        [complete past blocks | the step's blocks read back | the step's blocks unrounded].

        The step's blocks run from the one holding context_lens[b] on: the tail store's
        rows of it, then the step's keys (`StepBlocks`). A query sees past blocks and
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

    def _step_blocks(self, block_size: int) -> StepBlocks:
        if self._blocks is None:
            self._blocks = StepBlocks(self.g, block_size, self._past_length())
        return self._blocks

    def _gathered(self, index: int, name: str, slot_shape: list[int]) -> str:
        """Pool tensor `name` of layer `index` at the step's block tables, [B, M*bs, slot]."""
        g = self.g
        local = reads_local_table(self.arch.layers[index], "blocks")
        table = C.LOCAL_BLOCK_TABLES if local else C.BLOCK_TABLES
        blocks = g.op("Gather", [C.past_name(index, name), table], axis=0)
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
            self._masks[window] = additive_mask(self.g, self._past_length(), window)
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
            self.native.unsupported("a float LM head (Gemm): the native step multiplies "
                                    "int4/int8 codes")
        else:
            head = self._stored("lm_head", _np(self.ir.weights["lm_head.weight"]).T)
            logits = g.op("MatMul", [normed, head], name="lm_head")
            self.native.unsupported(_FLOAT_PROJECTIONS)
        if self.arch.final_softcap:
            self.native.unsupported("softcaps")
            cap = g.const(self.arch.final_softcap, np.float32)
            logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
        g.op_into("Identity", [logits], [C.LOGITS])



def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).numpy()


def _bias(weights: dict[str, torch.Tensor], prefix: str) -> np.ndarray:
    if f"{prefix}.bias" in weights:
        return _np(weights[f"{prefix}.bias"])
    return np.zeros(weights[f"{prefix}.weight"].shape[0], dtype=np.float32)
