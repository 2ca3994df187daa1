"""The manifest checked against the artifact's own graphs, before any session is built.

A hand-edited or mismatched manifest would otherwise surface at the first step as a raw
ONNX Runtime message (or not at all: a wrong `num_layers` or `eos_token_ids` is silently
obeyed). Reading a graph's inputs, outputs and initializer shapes costs milliseconds
(`onnx_signature` skips the weights).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmopt.runtime import contract as C
from llmopt.runtime.artifact import onnx_signature
from llmopt.runtime.artifact.onnx_signature import GraphSignature
from llmopt.runtime.manifest import CacheTensor, KVCacheSpec, Manifest

_PAST_INPUT = re.compile(r"past\.(\d+)\.(.+)")


class ManifestMismatch(ValueError):
    """The manifest says something its graphs contradict."""


def read_signature(file: Path) -> GraphSignature:
    """The graph's signature, its weights left unread."""
    try:
        return onnx_signature.read_signature(file)
    except (OSError, ValueError) as exc:  # ProtobufError, or bytes that are not UTF-8
        raise ManifestMismatch(f"{file.name} is not a readable ONNX graph ({exc})") from None


def check_manifest_against_graphs(path: Path, manifest: Manifest) -> None:
    """Every count, width and KV tensor the manifest states matches the graph it names."""
    check_token_ids(manifest)
    for graph in manifest.runnable_graphs():
        signature = read_signature(path / manifest.graphs[_graph_key(manifest, graph.name)].file)
        check_layers(signature, graph.num_layers, len(graph.kv_cache.layers),
                     graph.layers_field)
        check_logits_width(signature, graph.vocab_size, f"{graph.section}.vocab_size")
        check_positions(signature, graph.max_position, f"{graph.section}.max_position")
        check_kv_inputs(signature, graph.kv_cache, graph.kv_field)


def _graph_key(manifest: Manifest, name: str) -> str:
    if name not in manifest.graphs:
        raise ManifestMismatch(f"manifest graphs has no {name!r} graph")
    return name


def check_token_ids(manifest: Manifest) -> None:
    """EOS, BOS and pad ids inside the vocabulary (an id past it never gets sampled)."""
    vocab = manifest.model.vocab_size
    named = {"model.bos_token_id": manifest.model.bos_token_id,
             "model.pad_token_id": manifest.model.pad_token_id,
             **{f"model.eos_token_ids[{i}]": t
                for i, t in enumerate(manifest.model.eos_token_ids)}}
    for field, token in named.items():
        if token is not None and not 0 <= token < vocab:
            raise ManifestMismatch(f"manifest {field} is {token}, outside the vocabulary "
                                   f"[0, {vocab})")


def check_layers(signature: GraphSignature, num_layers: int, cache_layers: int,
                 field: str) -> None:
    """The layer count equals the layers whose KV pools the graph takes."""
    graph_layers = len({int(m.group(1)) for name in signature.inputs
                        if (m := _PAST_INPUT.fullmatch(name))})
    if num_layers != graph_layers:
        raise ManifestMismatch(f"manifest {field} is {num_layers} but the graph takes the KV "
                               f"cache of {graph_layers} layers")
    if cache_layers != graph_layers:
        raise ManifestMismatch(f"manifest kv_cache.layers lists {cache_layers} layers but the "
                               f"graph takes the KV cache of {graph_layers}")


def check_logits_width(signature: GraphSignature, vocab_size: int, field: str) -> None:
    if C.LOGITS not in signature.outputs:
        raise ManifestMismatch(f"the graph has no {C.LOGITS!r} output")
    width = signature.outputs[C.LOGITS][1][-1]
    if isinstance(width, int) and width and width != vocab_size:
        raise ManifestMismatch(f"manifest {field} is {vocab_size} but the graph's logits are "
                               f"{width} wide")


def check_positions(signature: GraphSignature, max_position: int, field: str) -> None:
    """Positions past the rotary tables would read outside them."""
    ropes = {name: dims[0] for name, dims in signature.initializers.items()
             if name.startswith("rope.") and name.endswith(".cos") and dims}
    for name, length in ropes.items():
        if max_position > length:
            raise ManifestMismatch(f"manifest {field} is {max_position} but the graph's rotary "
                                   f"table {name} covers {length} positions")


def check_kv_inputs(signature: GraphSignature, kv_cache: KVCacheSpec, field: str) -> None:
    """Each pool tensor the manifest lists is a graph input of its dtype and shape, and
    the graph takes no pool tensor the manifest leaves out."""
    expected = expected_kv_inputs(kv_cache)
    graph = {name: io for name, io in signature.inputs.items() if _PAST_INPUT.fullmatch(name)}
    for name, (dtype, shape) in expected.items():
        if name not in graph:
            raise ManifestMismatch(f"manifest {field} lists {name} but the graph has no such "
                                   "input")
        graph_dtype, graph_shape = graph[name]
        if dtype != graph_dtype:
            raise ManifestMismatch(f"manifest {field}: {name} is {dtype} but the graph "
                                   f"takes {graph_dtype}")
        if not _same_fixed_dims(shape, graph_shape):
            raise ManifestMismatch(f"manifest {field}: {name} has shape {_show(shape)} but the "
                                   f"graph takes {_show(graph_shape)}")
    extra = sorted(set(graph) - set(expected))
    if extra:
        raise ManifestMismatch(f"the graph takes {extra[0]} but manifest {field} does not "
                               "list it")


def expected_kv_inputs(kv_cache: KVCacheSpec) -> dict[str, tuple[str, list[int | str]]]:
    """The `past.*` inputs the manifest's KV layout implies: name -> (dtype, shape).

    Blocks: the paged pool [num_blocks, block_size, *slot_shape] ([num_blocks, *entry]
    for a per-block tensor); lanes: the rows' lanes [batch, kv_heads, capacity, head_dim]
    (slot shape [kv_heads, head_dim]). The runtime chooses the symbolic dimensions.
    """
    def shape(tensor: CacheTensor) -> list[int | str]:
        if kv_cache.layout == "lanes":  # a slot shape of another rank fails the check
            return ["batch", *tensor.slot_shape[:1], "capacity", *tensor.slot_shape[1:]]
        if tensor.per == "block":
            return ["num_blocks", *tensor.slot_shape]
        return ["num_blocks", "block_size", *tensor.slot_shape]

    return {C.past_name(index, tensor.name): (tensor.dtype, shape(tensor))
            for index, layer in enumerate(kv_cache.layers) for tensor in layer.tensors}


def _same_fixed_dims(expected: list[int | str], actual: list[int | str]) -> bool:
    """Same rank, and equal wherever both dimensions are fixed numbers."""
    return len(expected) == len(actual) and all(
        e == a for e, a in zip(expected, actual, strict=True)
        if isinstance(e, int) and isinstance(a, int) and a)


def _show(shape: list[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
