"""Read a compiled artifact back into a ModelIR: the target's architecture from the
manifest, its weights from the graph's initializers, quantized linears unpacked.

This is `lower.py` run backwards, so `export-hf` can start from an artifact instead of
re-running every pass. Initializer names are the lowering's (`lower._DecoderLowering`):
  embed_tokens, lm_head ([hidden, vocab]), norms by their IR names, rope.{name}.cos/sin;
  a fused linear `layers.{i}.q_proj_k_proj_v_proj` (or gate_proj_up_proj, o_proj,
  down_proj) as a float [K, N] MatMul weight, or as MatMulNBits inputs `{name}.B`,
  `.scales`, `.zero_points`, or as DequantizeLinear inputs `{name}.x`, `.x_scale`,
  `.x_zero_point`, plus `{name}.group_offset` for fractional zero points; `{name}.bias`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from llmopt.compiler.ir import ArchSpec, LayerSpec, ModelIR, RopeSpec
from llmopt.compiler.nf4 import read_codebook_linear
from llmopt.compiler.quant_format import (
    QuantizedLinear,
    join_fractional_zeros,
    slice_outputs,
    unpack_dequantize_linear,
    unpack_matmul_nbits,
)
from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.manifest import Manifest

FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                 ("down_proj",))


class ArtifactReadError(ValueError):
    """The artifact lacks what a Hugging Face export needs."""


def read_artifact(path: str | Path) -> ModelIR:
    """The target model of the artifact at `path` (its draft is not read)."""
    path = Path(path)
    manifest = load_manifest(path)  # hashes checked: the weights are the compiled ones
    if not manifest.ir.get("hf_config"):
        raise ArtifactReadError(
            f"{path} records no Hugging Face config (compiled by an llmopt older than "
            "export from artifacts); recompile it, or export from its recipe")
    graph = onnx.load(str(path / manifest.graphs["target"].file))  # with its external data
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.graph.initializer}
    arch = _arch(manifest.ir["arch"], initializers)
    ir = ModelIR(
        arch=arch, weights={}, source=str(manifest.ir.get("source", path)),
        tokenizer_files={f: (path / f).read_bytes() for f in _tokenizer_files(manifest)},
        tokenizer_spec=manifest.tokenizer,
        generation_defaults=dict(manifest.generation),
        annotations={"hf_config": manifest.ir["hf_config"],
                     "tokens": {"bos_token": manifest.tokenizer.bos_token,
                                "eos_token": manifest.tokenizer.eos_token}})
    _read_weights(ir, initializers, _quantized_nodes(graph))
    return ir


def _tokenizer_files(manifest: Manifest) -> list[str]:
    graph_files = {f for g in manifest.graphs.values() for f in (g.file, g.data_file) if f}
    draft = manifest.speculative.model if manifest.speculative else None
    token_map = {draft.token_map} if draft is not None and draft.token_map else set()
    return [f for f in manifest.files if f not in graph_files | token_map]


def _arch(record: dict, initializers: dict[str, np.ndarray]) -> ArchSpec:
    """ArchSpec from the manifest's record; rotary frequencies from the graph's tables
    (the manifest keeps only their count): inv_freq = atan2(sin, cos) at position 1."""
    fields = dict(record)
    ropes = {}
    for name, rope in fields["ropes"].items():
        cos, sin = initializers[f"rope.{name}.cos"][1], initializers[f"rope.{name}.sin"][1]
        inv_freq = tuple(float(f) for f in np.arctan2(sin, cos).astype(np.float32))
        ropes[name] = RopeSpec(rope["rope_type"], inv_freq, rope["attention_factor"])
    fields.update(layers=tuple(LayerSpec(**layer) for layer in fields["layers"]), ropes=ropes,
                  eos_token_ids=tuple(fields["eos_token_ids"]))
    known = {f.name for f in dataclasses.fields(ArchSpec)}
    return ArchSpec(**{k: v for k, v in fields.items() if k in known})


def _quantized_nodes(graph: onnx.ModelProto) -> dict[str, dict]:
    """Fused linear name -> the attributes of the node that consumes its integer weights."""
    nodes = {}
    for node in graph.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in ("MatMulNBits", "MatMulBnb4"):
            nodes[node.input[1].removesuffix(".B")] = attrs
        elif node.op_type == "Gather" and node.input[0].endswith(".codebook"):  # standard NF4
            nodes[node.input[0].removesuffix(".codebook")] = attrs
        elif node.op_type == "DequantizeLinear" and node.input[0].endswith(".x"):
            nodes[node.input[0].removesuffix(".x")] = attrs
    return nodes


def _read_weights(ir: ModelIR, initializers: dict[str, np.ndarray],
                  nodes: dict[str, dict]) -> None:
    arch = ir.arch
    for name, array in initializers.items():  # norms keep their IR names
        if name.endswith("_norm") or name == "final_norm":
            ir.weights[name] = _float(array)
    if "embed_tokens" in initializers:  # else gathered from the tied head's codes (below)
        ir.weights["embed_tokens"] = _float(initializers["embed_tokens"])
    if not arch.tie_word_embeddings and "lm_head" in initializers:
        ir.weights["lm_head.weight"] = _float(initializers["lm_head"]).T.contiguous()
    for index, layer in enumerate(arch.layers):
        sizes = {"q_proj": layer.num_heads * layer.head_dim,
                 "k_proj": layer.num_kv_heads * layer.head_dim,
                 "v_proj": layer.num_kv_heads * layer.head_dim,
                 "o_proj": arch.hidden_size, "gate_proj": arch.intermediate_size,
                 "up_proj": arch.intermediate_size, "down_proj": arch.hidden_size}
        for parts in FUSED_LINEARS:
            _read_linear(ir, initializers, nodes, f"layers.{index}.", parts, sizes)
    if "lm_head" in nodes:
        ir.set_quantized("lm_head", _quantized(initializers, nodes, "lm_head"))  # tied: the
        if "embed_tokens" in initializers:  # embedding too, unless the graph has its own
            ir.weights["embed_tokens"] = _float(initializers["embed_tokens"])


def _read_linear(ir: ModelIR, initializers: dict[str, np.ndarray], nodes: dict[str, dict],
                 prefix: str, parts: tuple[str, ...], sizes: dict[str, int]) -> None:
    """One fused linear of the graph back to its parts' IR weights (and biases)."""
    name = prefix + "_".join(parts)
    bounds = np.cumsum([0] + [sizes[p] for p in parts])
    if name in nodes:
        q = _quantized(initializers, nodes, name)
        for part, start, stop in zip(parts, bounds[:-1], bounds[1:], strict=True):
            ir.set_quantized(prefix + part, slice_outputs(q, int(start), int(stop)))
    else:
        weight = _float(initializers[name]).T
        for part, start, stop in zip(parts, bounds[:-1], bounds[1:], strict=True):
            ir.weights[f"{prefix}{part}.weight"] = weight[start:stop].contiguous()
    if f"{name}.bias" in initializers:
        bias = _float(initializers[f"{name}.bias"])
        for part, start, stop in zip(parts, bounds[:-1], bounds[1:], strict=True):
            ir.weights[f"{prefix}{part}.bias"] = bias[start:stop].clone()


def _quantized(initializers: dict[str, np.ndarray], nodes: dict[str, dict],
               name: str) -> QuantizedLinear:
    attrs = nodes[name]
    if f"{name}.absmax" in initializers or f"{name}.codebook" in initializers:
        return read_codebook_linear(initializers, name, attrs)
    if f"{name}.B" in initializers:
        arrays = {key: initializers[f"{name}.{key}"] for key in ("B", "scales", "zero_points")
                  if f"{name}.{key}" in initializers}
        q = unpack_matmul_nbits(arrays, attrs["K"], attrs["bits"], attrs["block_size"])
    else:
        arrays = {key: initializers[f"{name}.{key}"] for key in ("x", "x_scale", "x_zero_point")
                  if f"{name}.{key}" in initializers}
        q = unpack_dequantize_linear(arrays, attrs["block_size"])
    if f"{name}.group_offset" in initializers:
        q = join_fractional_zeros(q, initializers[f"{name}.group_offset"])
    return q


def _float(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
