"""The KV layout a model is lowered with, and the manifest's description of its pools.

Two layouts (see `llmopt.runtime.contract`): "blocks" gathers a step's blocks and attends
over the copy (any KV dtype, any operator set); "lanes" gives each sequence a contiguous
lane that ONNX Runtime's GroupQueryAttention reads and appends to in place. The runtime
reads the `kv_cache` section written here and nothing else of the compiler.
"""

from __future__ import annotations

from llmopt.compiler.ir import ArchSpec, LayerSpec
from llmopt.compiler.kv_cache_format import block_side, kv_sides


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
                        "tail": tail_tensors(spec), "window": spec.sliding_window,
                        "local": reads_local_table(spec, layout)} for spec in arch.layers],
            "sink_tokens": max(spec.kv_sink_tokens for spec in arch.layers),
            "block_size": max((spec.kv_block_size for spec in arch.layers if spec.kv_block_size),
                              default=None)}


def reads_local_table(spec: LayerSpec, layout: str) -> bool:
    """Whether a layer reads the local block table, whose blocks behind its sliding window
    the runtime frees (blocks layout; sinks and per-block key scales stay on the full
    table, their stores being keyed by its blocks)."""
    return (layout == "blocks" and spec.sliding_window is not None
            and not spec.kv_sink_tokens and not kv_sides(spec)[0].per_block)


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

