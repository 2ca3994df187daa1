"""The native step's plan: where each weight of a lanes graph lies, for `llmopt.runtime.native`.

The runtime's native decoder step (one C call per step, see runtime/native/kernels.c)
computes what a lanes graph computes, for the graphs it knows: a llama-style decoder
(RMS norms, fused QKV and gate/up projections, SiLU, GroupQueryAttention with rotary, no
softcap; biases added to projections, as Qwen2's q/k/v, and RMS norms of each query and key
head before rotary, as Qwen3's, are taken; a sliding window, as Mistral's, is recorded:
the runtime runs the step only where a lane holds no more tokens than the window, so that
the window never hides a key) whose projections are
MatMulNBits at accuracy level 4 with 4- or 8-bit codes in blocks of 32, 64 or 128, and KV
lanes of float32 or, per layer, the KV-cache pass's float16 or int8/int4 codes with static
per-channel scales (rotary and an optional rotation of queries and keys run before the node
then, and the step's keys and values are rounded to their codes, or the node's inputs cast
to float16: `_quantized_kv` and `_float16_kv` read those chains). The plan is read off the
saved graph itself, so it describes exactly what ONNX Runtime runs; a graph with anything
else gets `{"unsupported": reason}` and the runtime keeps ONNX Runtime.

The plan is typed (runtime/native/plan.py's NativePlan, or Unsupported); the manifest
holds its `to_manifest()`. A tensor lies at an offset of the graph's weights file, or has
its values inline when small enough to stay inside the ONNX file.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmopt.compiler.nf4 import FP4_CODE, NF4_CODE
from llmopt.runtime import contract as C
from llmopt.runtime.native.plan import (
    EmbeddingRows,
    LaneKV,
    LayerPlan,
    NativePlan,
    QuantizedMatrix,
    Tensor,
)
from llmopt.runtime.native.plan import (
    Unsupported as UnsupportedPlan,
)

_BLOCKS = (32, 64, 128)  # the kernels' quantization blocks, for weights and activations
_SLICE = 32  # the columns of the kernels' packed layout: every K is a multiple
_VECTOR = 16  # float32 lanes of the kernels' vectors: every width is a multiple


# MatMulBnb4's quant_type -> its code book (ONNX Runtime's built-in FP4 and NF4 tables).
BNB4_CODEBOOKS = {0: tuple(FP4_CODE.tolist()), 1: tuple(NF4_CODE.tolist())}


class Unsupported(Exception):
    pass


def native_plan(model: onnx.ModelProto, accuracy_level: int | None = None
                ) -> NativePlan | UnsupportedPlan:
    """The plan of a saved graph (its initializers already moved to external data);
    `accuracy_level`: the recipe's, which MatMulBnb4 nodes (float activations in the graph)
    do not record: at 4 the native step runs them on int8 activations too."""
    try:
        return _Planner(model.graph, accuracy_level).plan()
    except Unsupported as reason:
        return UnsupportedPlan(str(reason))


class _Planner:
    def __init__(self, graph: onnx.GraphProto, accuracy_level: int | None = None):
        self.nodes = list(graph.node)
        self.tensors = {t.name: t for t in graph.initializer}
        self.by_weight = {n.input[1]: n for n in self.nodes
                          if n.op_type in ("MatMulNBits", "MatMulBnb4")}
        self.accuracy_level = accuracy_level
        self.producer = {out: n for n in self.nodes for out in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.offsets = {n.input[1]: self._group_offsets(n) for n in self.by_weight.values()}
        self.biases = {n.input[1]: self._bias(n) for n in self.by_weight.values()}
        self.head_norms: dict[str, tuple[str, str]] = {}  # attention output -> q, k norms

    def plan(self) -> NativePlan:
        attention = [n for n in self.nodes if n.op_type == "GroupQueryAttention"]
        if not attention:
            raise Unsupported("not a lanes graph (no GroupQueryAttention)")
        layers = len(attention)
        if any(self._accuracy_level(n) != 4 for n in self.by_weight.values()):
            raise Unsupported("float activations (nbits_accuracy_level 0): the native step "
                              "multiplies int8 activations")
        kv = [self._lane_kv(n) for n in attention]
        heads, kv_heads, scale, cos, sin, window = self._attention(attention, kv)
        self._check_node_counts(layers, [entry for entry in kv if entry])
        head_dim = self._dims(cos)[1] * 2
        norms = [n for n in self.nodes if "LayerNormalization" in n.op_type]
        eps = {round(_attrs(n)["epsilon"], 12) for n in norms}
        if len(eps) != 1:
            raise Unsupported(f"the norms use different epsilons {sorted(eps)}")
        rope = (self._tensor(cos), self._tensor(sin))
        embed = self._embedding()
        planned = tuple(self._layer(i, kv[i], attention[i]) for i in range(layers))
        final_norm, head = self._tensor("final_norm"), self._matmul(self._node_of("lm_head.B"))
        hidden = planned[0].o.n
        # a window: runtime/native/library.py's unavailable_reason checks it
        plan = NativePlan(eps.pop(), heads, kv_heads, head_dim, scale, *rope, embed, planned,
                          final_norm, head, hidden, planned[0].down.k, head.n, window)
        if hidden % _VECTOR or head_dim % _VECTOR or head_dim > 256:
            raise Unsupported(f"hidden size {hidden} or head_dim {head_dim} is not a multiple "
                              f"of {_VECTOR} (head_dim up to 256)")
        if (heads // kv_heads) * head_dim > 8 * 256:
            raise Unsupported(f"{heads // kv_heads} query heads of {head_dim} share a KV head")
        return plan

    def _check_node_counts(self, layers: int, quantized: list[LaneKV]) -> None:
        offset = sum(o is not None for o in self.offsets.values())  # two MatMuls and an Add
        biases = sum(b is not None for b in self.biases.values())  # an Add each
        expected = Counter({
            "MatMulNBits": 4 * layers + 1, "GroupQueryAttention": layers,
            "SimplifiedLayerNormalization": 2, "SkipSimplifiedLayerNormalization": 2 * layers - 1,
            "Split": layers, "Sigmoid": layers, "Mul": 2 * layers, "Add": 1 + offset + biases,
            "Reshape": 1, "Identity": 1, "MatMul": 2 * offset})
        for kv in quantized:  # the chain `_quantized_kv` or `_float16_kv` read
            expected.update({"Split": 1, "RotaryEmbedding": 2})
            if kv.bits == 16:
                expected.update({"Cast": 4})
            else:
                expected.update({"Div": 2, "Round": 2, "Clip": 2, "Mul": 2})
            if kv.rotation is not None:
                expected.update({"Reshape": 4, "MatMul": 2})
        if self.head_norms:  # per layer: a Reshape, a norm and a Reshape for each side
            expected.update({"Reshape": 4 * len(self.head_norms),
                             "SimplifiedLayerNormalization": 2 * len(self.head_norms)})
            # float32 lanes take queries, keys and values from a Split of their own
            expected.update({"Split": layers - len(quantized)})
        if quantized:  # the step's positions, built once (lower.py's _lane_positions)
            expected.update({"Add": 2, "Sub": 1, "Cast": 1, "Unsqueeze": 1, "Gather": 1,
                             "Shape": 1, "Range": 1, "Min": 1})
        counts = Counter(n.op_type for n in self.nodes)
        counts["MatMulNBits"] += counts.pop("MatMulBnb4", 0)  # either form of a projection
        if counts["MatMul"] > expected["MatMul"]:
            raise Unsupported("float projections (MatMul): the native step multiplies int4/int8 "
                              "codes")
        embed = counts.pop("GatherBlockQuantized", 0)
        counts["Gather"] -= 2 - embed  # the embedding (unless quantized) and the logits rows
        if +counts != expected:
            extra = sorted(set((+counts).elements()) - set(expected)) or sorted(
                op for op in expected if counts[op] != expected[op])
            raise Unsupported(f"a graph the native step does not know ({', '.join(extra)})")

    def _attention(self, nodes: list[onnx.NodeProto], kv: list[LaneKV | None]
                   ) -> tuple[int, int, float, str, str, int | None]:
        """The attention nodes' shared shape, rotary tables and sliding window (None: none),
        noting Qwen3's head norms (head_norms) on the way."""
        shapes = set()
        for n, quantized in zip(nodes, kv, strict=True):
            attrs = _attrs(n)
            if "softcap" in attrs:
                raise Unsupported("softcaps")
            if quantized:  # rotary before the node (see _quantized_kv)
                queries = self._uncast(n.input[0], onnx.TensorProto.FLOAT16)
                tables = tuple(self._rotated(queries)[0].input[2:4])
            elif attrs.get("do_rotary") != 1 or attrs.get("rotary_interleaved", 0):
                raise Unsupported("attention without fused non-interleaved rotary")
            else:
                if any(n.input[1:3]):  # only head norms between the Split and the node
                    self._split_sides(n, n.input[0], n.input[1], n.input[2])
                tables = (n.input[7], n.input[8])
            shapes.add((attrs["num_heads"], attrs["kv_num_heads"], float(attrs["scale"]),
                        *tables, attrs.get("local_window_size")))
        if len(shapes) != 1:
            raise Unsupported("layers with different attention shapes or sliding windows")
        return shapes.pop()

    def _lane_kv(self, node: onnx.NodeProto) -> LaneKV | None:
        """How a GroupQueryAttention node's lanes hold keys and values (None: float32)."""
        if "k_quant_type" in _attrs(node):
            return self._quantized_kv(node)
        cast = self.producer.get(node.input[0])
        if cast is not None and cast.op_type == "Cast":
            return self._float16_kv(node)
        return None

    def _float16_kv(self, node: onnx.NodeProto) -> LaneKV:
        """A float16 lanes layer (lower.py's `_lane_attention`): the node's queries, keys and
        values cast to float16 after rotary (and rotation), its output cast back."""
        q, k, values = (self._uncast(name, onnx.TensorProto.FLOAT16) for name in node.input[:3])
        out = self.consumers.get(node.output[0], [])
        if len(out) != 1 or self._uncast(out[0].output[0]) != node.output[0]:
            raise Unsupported("a float16 attention output not cast back to float32")
        return LaneKV(16, None, None, self._lane_rotation(node, q, k, values))

    def _uncast(self, name: str, to: int = onnx.TensorProto.FLOAT) -> str:
        """The input of the Cast to `to` that produces `name` (`name` if none does)."""
        node = self.producer.get(name)
        if node is None or node.op_type != "Cast":
            return name
        if _attrs(node)["to"] != to:
            raise Unsupported(f"{name}: a cast to an unexpected type")
        return node.input[0]

    def _quantized_kv(self, node: onnx.NodeProto) -> LaneKV:
        """A quantized lanes layer (lower.py's `_lane_attention`): the queries and keys
        rotary-embedded (and rotated) from the Split of the fused projection, keys and values
        rounded to their codes with the static per-channel scales the node stores them with."""
        attrs = _attrs(node)
        bits = attrs.get("kv_cache_bit_width")
        if (attrs.get("k_quant_type"), attrs.get("v_quant_type")) != (b"PER_CHANNEL",) * 2 or (
                bits not in (4, 8)):
            raise Unsupported("quantized KV lanes other than int8/int4 per channel")
        key_scale, value_scale = node.input[12], node.input[13]
        rotation = self._lane_rotation(node, node.input[0],
                                       self._rounded(node.input[1], key_scale, bits),
                                       self._rounded(node.input[2], value_scale, bits))
        for name in (key_scale, value_scale):
            if self.tensors[name].data_type != onnx.TensorProto.FLOAT:
                raise Unsupported(f"{name} is not float32")
        return LaneKV(bits, self._tensor(key_scale), self._tensor(value_scale), rotation)

    def _lane_rotation(self, node: onnx.NodeProto, queries: str, keys: str,
                       values: str) -> Tensor | None:
        """The rotation of the node's queries and keys, if any, once checked that they and
        the values come from one Split of the fused projection, the queries and keys
        rotary-embedded (and rotated) alike."""
        attrs = _attrs(node)
        q_rope, q_rotation = self._rotated(queries)
        k_rope, k_rotation = self._rotated(keys)
        sizes = self._split_sides(node, q_rope.input[0], k_rope.input[0], values)
        if q_rotation != k_rotation or q_rope.input[2:4] != k_rope.input[2:4]:
            raise Unsupported("queries and keys embedded or rotated differently")
        head_dim = sizes[1] // attrs["kv_num_heads"]
        if q_rotation and (self._dims(q_rotation) != [head_dim, head_dim]
                           or self.tensors[q_rotation].data_type != onnx.TensorProto.FLOAT):
            raise Unsupported(f"{q_rotation} is not a float32 [{head_dim}, {head_dim}] rotation")
        return self._tensor(q_rotation) if q_rotation else None

    def _split_sides(self, node: onnx.NodeProto, queries: str, keys: str, values: str
                     ) -> list[float]:
        """Checks that a GroupQueryAttention node's queries, keys and values (before rotary)
        come from one Split of the fused projection, the queries and keys through an RMS
        norm of each head or neither (noted in head_norms); returns the Split's sizes."""
        attrs = _attrs(node)
        (q_source, q_norm), (k_source, k_norm) = self._head_normed(queries), self._head_normed(keys)
        split = self.producer.get(values)
        sizes = self._scalars(split.input[1]) if split is not None else []
        if (split is None or split.op_type != "Split"
                or list(split.output) != [q_source, k_source, values] or len(sizes) != 3
                or sizes[0] * attrs["kv_num_heads"] != sizes[1] * attrs["num_heads"]
                or sizes[1] != sizes[2]):
            raise Unsupported("KV lanes not fed by a Split of queries, keys, values")
        if (q_norm is None) != (k_norm is None):
            raise Unsupported("a norm of the query heads or of the key heads, not both")
        if q_norm is not None:
            head_dim = sizes[1] // attrs["kv_num_heads"]
            for norm in (q_norm, k_norm):
                if (self._dims(norm) != [head_dim]
                        or self.tensors[norm].data_type != onnx.TensorProto.FLOAT):
                    raise Unsupported(f"{norm} is not a float32 [{head_dim}] head norm")
            self.head_norms[node.output[0]] = (q_norm, k_norm)
        return sizes

    def _head_normed(self, name: str) -> tuple[str, str | None]:
        """The tensor behind an RMS norm of each head (Reshape to heads, the norm, Reshape
        back: lower.py's `_head_norm`) and the norm's weight; (`name`, None) if none."""
        back = self.producer.get(name)
        norm = self.producer.get(back.input[0]) if back and back.op_type == "Reshape" else None
        if norm is None or norm.op_type != "SimplifiedLayerNormalization":
            return name, None
        heads = self.producer.get(norm.input[0])
        if heads is None or heads.op_type != "Reshape" or norm.input[1] not in self.tensors:
            raise Unsupported(f"{name}: a norm of something other than heads")
        return heads.input[0], norm.input[1]

    def _rotated(self, name: str) -> tuple[onnx.NodeProto, str | None]:
        """The RotaryEmbedding node behind `name`, and the rotation matrix applied after it
        (Reshape, MatMul by a weight, Reshape), if any."""
        node, rotation = self.producer.get(name), None
        if node is not None and node.op_type == "Reshape":
            matmul = self.producer.get(node.input[0])
            if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in self.tensors:
                raise Unsupported(f"{name}: not a rotation of rotary-embedded heads")
            rotation = matmul.input[1]
            reshape = self.producer.get(matmul.input[0])
            node = self.producer.get(reshape.input[0]) if reshape is not None else None
        if (node is None or node.op_type != "RotaryEmbedding"
                or _attrs(node).get("interleaved", 0)):
            raise Unsupported(f"{name}: queries or keys without non-interleaved rotary")
        return node, rotation

    def _rounded(self, name: str, scale: str, bits: int) -> str:
        """x behind `name` = Mul(Clip(Round(Div(x, scale)), low, high), scale), the storage
        round trip of `bits` codes (kv_cache_format's emit_round_trip)."""
        low, high = {8: (-127, 127), 4: (-8, 7)}[bits]
        mul = self.producer.get(name)
        clip = self.producer.get(mul.input[0]) if mul is not None else None
        round_ = self.producer.get(clip.input[0]) if clip is not None else None
        div = self.producer.get(round_.input[0]) if round_ is not None else None
        chain = [n.op_type if n is not None else None for n in (mul, clip, round_, div)]
        if (chain != ["Mul", "Clip", "Round", "Div"] or mul.input[1] != scale
                or div.input[1] != scale
                or [*self._scalars(clip.input[1]), *self._scalars(clip.input[2])] != [low, high]):
            raise Unsupported(f"{name}: not the {bits}-bit round trip of its static scale")
        return div.input[0]

    def _scalars(self, name: str) -> list[float]:
        """The values of a small initializer kept inside the graph (none for anything else)."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.external_data:
            return []
        return numpy_helper.to_array(tensor).reshape(-1).tolist()

    def _embedding(self) -> Tensor | EmbeddingRows:
        gather = next(n for n in self.nodes if C.INPUT_IDS in n.input)
        if gather.op_type == "Gather":
            return self._tensor(gather.input[0])
        attrs = _attrs(gather)
        if attrs.get("block_size") not in _BLOCKS or attrs.get("bits") not in (4, 8):
            raise Unsupported("a quantized embedding in blocks other than 32, 64 or 128")
        codes = self._dims(gather.input[0])
        zeros = gather.input[3] if len(gather.input) > 3 and gather.input[3] else None
        return EmbeddingRows(self._tensor(gather.input[0]), self._tensor(gather.input[2]),
                             self._tensor(zeros) if zeros else None, attrs["bits"],
                             attrs["block_size"], codes[0], codes[1] * 8 // attrs["bits"])

    def _layer(self, i: int, kv: LaneKV | None, attention: onnx.NodeProto) -> LayerPlan:
        p = f"layers.{i}."
        norms = self.head_norms.get(attention.output[0])
        norm_tensors = (self._tensor(p + "attn_norm"), self._tensor(p + "mlp_norm"))
        matrices = [self._matmul(self._node_of(p + weight)) for weight in (
            "q_proj_k_proj_v_proj.B", "o_proj.B", "gate_proj_up_proj.B", "down_proj.B")]
        # kv None: float32 lanes; norms: RMS norms of each query and key head (Qwen3)
        return LayerPlan(*norm_tensors, *matrices, kv=kv,
                         q_norm=self._tensor(norms[0]) if norms else None,
                         k_norm=self._tensor(norms[1]) if norms else None)

    def _node_of(self, weight: str) -> onnx.NodeProto:
        if weight not in self.by_weight:
            raise Unsupported(f"no int-coded projection {weight.removesuffix('.B')}")
        return self.by_weight[weight]

    def _accuracy_level(self, node: onnx.NodeProto) -> int | None:
        if node.op_type == "MatMulBnb4":
            return self.accuracy_level
        return _attrs(node).get("accuracy_level", 0)

    def _matmul(self, node: onnx.NodeProto) -> QuantizedMatrix:
        if node.op_type == "MatMulBnb4":
            return self._codebook_matmul(node)
        attrs = _attrs(node)
        if attrs["block_size"] not in _BLOCKS or attrs["bits"] not in (4, 8):
            raise Unsupported(f"{node.input[1]}: {attrs['bits']}-bit codes in blocks of "
                              f"{attrs['block_size']} (the native step takes 4/8-bit; "
                              "32, 64, 128)")
        if attrs["K"] % _SLICE:
            raise Unsupported(f"{node.input[1]}: K {attrs['K']} is not a multiple of {_SLICE}")
        zeros = node.input[3] if len(node.input) > 3 and node.input[3] else None
        if zeros and self.tensors[zeros].data_type != onnx.TensorProto.UINT8:
            raise Unsupported("fractional zero points")
        if len(node.input) > 4 and any(node.input[4:]):
            raise Unsupported("MatMulNBits with g_idx or bias")
        offsets, bias = self.offsets.get(node.input[1]), self.biases.get(node.input[1])
        return QuantizedMatrix(self._tensor(node.input[1]), self._tensor(node.input[2]),
                               self._tensor(zeros) if zeros else None, attrs["bits"],
                               attrs["block_size"], attrs["N"], attrs["K"],
                               self._tensor(offsets) if offsets else None,
                               self._tensor(bias) if bias else None)

    def _codebook_matmul(self, node: onnx.NodeProto) -> QuantizedMatrix:
        """MatMulBnb4 (NF4 or FP4 code book, runtime/native/codebook.py)."""
        attrs = _attrs(node)
        if attrs["block_size"] not in _BLOCKS or attrs["K"] % attrs["block_size"]:
            raise Unsupported(f"{node.input[1]}: code-book blocks of {attrs['block_size']} "
                              f"(the native step takes 32, 64, 128 dividing K)")
        if attrs["K"] % _SLICE:
            raise Unsupported(f"{node.input[1]}: K {attrs['K']} is not a multiple of {_SLICE}")
        bias = self.biases.get(node.input[1])
        return QuantizedMatrix(self._tensor(node.input[1]), self._tensor(node.input[2]), None, 4,
                               attrs["block_size"], attrs["N"], attrs["K"], None,
                               self._tensor(bias) if bias else None,
                               BNB4_CODEBOOKS[attrs.get("quant_type", 1)])

    def _bias(self, node: onnx.NodeProto) -> str | None:
        """The float32 [N] initializer lower.py's `_linear` adds to the projection's output
        (after its group offsets' Add, if any), or None."""
        out = node.output[0]
        if self._group_offsets(node):  # the bias is added to the offsets' sum
            out = next(a.output[0] for a in self.consumers[out] if a.op_type == "Add")
        for add in self.consumers.get(out, []):
            other = [name for name in add.input if name != out]
            if (add.op_type == "Add" and len(other) == 1 and other[0] in self.tensors
                    and other[0].endswith(".bias")
                    and self.tensors[other[0]].data_type == onnx.TensorProto.FLOAT
                    and self._dims(other[0]) == [_attrs(node)["N"]]):
                return other[0]
        return None

    def _group_offsets(self, node: onnx.NodeProto) -> str | None:
        """The [K/32, N] offsets of fractional zero points (compiler/quant_format's
        split_fractional_zeros), when the projection's output is added to
        MatMul(MatMul(its input, group sums of 32), offsets); else None."""
        for add in self.consumers.get(node.output[0], []):
            if add.op_type != "Add":
                continue
            other = self.producer.get(next(i for i in add.input if i != node.output[0]))
            if other is None or other.op_type != "MatMul" or other.input[1] not in self.tensors:
                continue
            sums = self.producer.get(other.input[0])
            if (sums is not None and sums.op_type == "MatMul" and sums.input[0] == node.input[0]
                    and sums.input[1].startswith("group_sum.") and sums.input[1].endswith(".32")):
                return other.input[1]
        return None

    def _dims(self, name: str) -> list[int]:
        return list(self.tensors[name].dims)

    def _tensor(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise Unsupported(f"no weight {name}")
        t = self.tensors[name]
        dtype, shape = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).name, tuple(t.dims)
        external = {e.key: e.value for e in t.external_data}
        if external:
            return Tensor(dtype, shape, int(external.get("offset", 0)), int(external["length"]))
        return Tensor(dtype, shape, values=tuple(numpy_helper.to_array(t).reshape(-1).tolist()))


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}
