"""`llmopt inspect`: what an artifact holds, what each pass did, what the KV cache costs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.manifest import GraphSpec, KVCacheSpec, Manifest, layer_bytes_per_token
from llmopt.runtime.native import unavailable_reason

_MIB = 1024 * 1024


def describe(path: str | Path, pool_mib: float = 1024.0) -> dict[str, Any]:
    path = Path(path)
    manifest = load_manifest(path)
    sizes = {name: (path / name).stat().st_size for name in manifest.files}
    kv_bytes = manifest.kv_cache.bytes_per_token()
    arch = manifest.ir.get("arch", {})
    return {
        "path": str(path),
        "format_version": manifest.format_version,
        "source": manifest.ir.get("source"),
        "family": arch.get("family"),
        "parameters": manifest.ir.get("parameters"),
        "layers": manifest.model.num_layers,
        "vocab_size": manifest.model.vocab_size,
        "max_position": manifest.model.max_position,
        "graphs": {name: {**g.model_dump(exclude={"native"}),
                          "native_step": _native_step(name, g, manifest)}
                   for name, g in manifest.graphs.items()},
        "files": sizes,
        "total_bytes": sum(sizes.values()),
        "kv_dtypes": sorted({t.dtype for layer in manifest.kv_cache.layers for t in layer.tensors}),
        "kv_bytes_per_token": kv_bytes,
        "kv_heads_per_layer": [layer.get("num_kv_heads") for layer in arch.get("layers", [])],
        "pool_mib": pool_mib,
        "tokens_in_pool": int(pool_mib * _MIB // kv_bytes),
        "kv_layout": kv_layout(manifest.kv_cache),
        "kv_sink_tokens": manifest.kv_cache.sink_tokens,
        "kv_sink_bytes_per_sequence": manifest.kv_cache.sink_bytes_per_sequence(),
        "kv_block_size": manifest.kv_cache.block_size,
        "kv_tail_bytes_per_sequence": manifest.kv_cache.tail_bytes_per_sequence(),
        # float32 keys and values of the same shapes (the compiler's IR record): the baseline.
        "kv_float32_bytes_per_token": sum(8 * layer["num_kv_heads"] * layer["head_dim"]
                                          for layer in arch.get("layers", [])) or None,
        "sequences_in_pool": {
            str(context): manifest.kv_cache.sequences_in_pool(
                pool_mib * _MIB, context, manifest.runtime.block_size)
            for context in sorted({2048, manifest.runtime.max_context})},
        "kv_bytes_per_sequence": {
            str(context): manifest.kv_cache.bytes_per_sequence(
                context, manifest.runtime.block_size)
            for context in sorted({2048, 32768, manifest.runtime.max_context})},
        "kv_local_window": manifest.kv_cache.local_window(),
        "passes": manifest.passes,
        "weights": _weights(manifest),
        "speculative": (manifest.speculative.model_dump(exclude={"measured"})
                        if manifest.speculative else None),
        "tokenizer": _tokenizer_facts(manifest),
        "generation": manifest.generation,
        "runtime": manifest.runtime.model_dump(),
        "tools": manifest.tools,
    }


def _weights(manifest: Manifest) -> dict[str, Any]:
    """The storage dtype and what each weight-quantization pass did (from its report)."""
    quantized = []
    for report in manifest.passes:
        config = report.get("config") or {}
        if "linears" not in report or "weight_bytes" not in report:
            continue  # not a weight-quantization pass
        quantized.append({
            "pass": report["name"], "bits": config.get("bits"),
            "group_size": config.get("group_size"), "symmetric": config.get("symmetric"),
            "format": config.get("format", "int"), "double_quant": config.get("double_quant"),
            "linears": report["linears"],  # an unset head (None) is an included one
            "lm_head": config.get("include_lm_head", False) is not False,
            "bytes": report["weight_bytes"].get("quantized"),
            "float32_bytes": report["weight_bytes"].get("float32")})
    storage = manifest.recipe.get("target", {}).get("weight_dtype", "float32")
    return {"storage": storage, "quantized": quantized}


def kv_layout(kv_cache: KVCacheSpec) -> dict[str, Any]:
    """The pool tensors of runs of layers with the same layout, and float32's cost."""
    groups: list[dict[str, Any]] = []
    for index, layer in enumerate(kv_cache.layers):
        tensors = " + ".join(f"{t.name} {t.dtype}{t.slot_shape}"
                             + (" a block" if t.per == "block" else "") for t in layer.tensors)
        if groups and groups[-1]["tensors"] == tensors:
            groups[-1]["layers"] = f"{groups[-1]['layers'].split('-')[0]}-{index}"
            continue
        groups.append({"layers": str(index), "tensors": tensors,
                       "bytes_per_token": layer_bytes_per_token(layer, kv_cache.block_size)})
    return {"pool": kv_cache.layout, "groups": groups}


def _sequence_lines(info: dict[str, Any]) -> list[str]:
    """KV bytes a decoding sequence holds per context, by layer group."""
    window = info["kv_local_window"]
    lines = []
    for context, held in info["kv_bytes_per_sequence"].items():
        text = f"  at {context} tokens: {held['full'] / _MIB:.2f} MiB"
        if window:
            text += (f" full-attention layers + {held['sliding'] / _MIB:.2f} MiB sliding-"
                     f"window layers (their {window}-token window; blocks behind it freed)")
        lines.append(text)
    return ["KV a sequence holds", *lines]


def _per_layer(values: list) -> str:
    """`3 (every layer)`, or each layer's value in layer order."""
    if len(set(values)) == 1:
        return f"{values[0]} (every layer)"
    return " ".join(str(v) for v in values) + " (per layer)" if values else "unknown"


def format_description(info: dict[str, Any]) -> str:
    lines = [
        f"artifact      {info['path']} (format {info['format_version']})",
        f"source        {info['source']} ({info['family']}, "
        f"{(info['parameters'] or 0) / 1e6:.1f} M parameters, {info['layers']} layers)",
        f"size          {info['total_bytes'] / _MIB:.1f} MiB",
    ]
    lines += [f"  {name:<22} {size / _MIB:10.2f} MiB" for name, size in info["files"].items()]
    for name, graph in info["graphs"].items():
        lines.append(f"graph {name:<7} {graph['file']} (opset {graph['opset']}, "
                     f"{graph['operator_set']} operators, {graph['nodes']} nodes, "
                     f"{graph['nodes_per_layer']} per layer)")
        lines.append(f"  native step {graph['native_step']}")
    fp32 = info["kv_float32_bytes_per_token"]
    ratio = f" ({fp32 / info['kv_bytes_per_token']:.2f}x smaller than float32)" if fp32 else ""
    sequences = ", ".join(f"{n} at context {c}" for c, n in info["sequences_in_pool"].items())
    lines += [
        f"KV cache      {', '.join(info['kv_dtypes'])}, {info['kv_bytes_per_token']} bytes/token"
        f"{ratio}; {info['tokens_in_pool']} tokens fit in "
        f"{info['pool_mib']:g} MiB (sequences: {sequences})",
        f"KV heads      {_per_layer(info['kv_heads_per_layer'])}",
        f"KV pool       {info['kv_layout']['pool']} layout"
        + (" (a lane per sequence, read in place)" if info["kv_layout"]["pool"] == "lanes"
           else " (blocks gathered per step)"),
    ]
    lines += [f"  {'layers' if '-' in group['layers'] else 'layer'} {group['layers']}: "
              f"{group['tensors']} ({group['bytes_per_token']} bytes/token each)"
              for group in info["kv_layout"]["groups"]]
    lines += _sequence_lines(info)
    if info["kv_sink_tokens"]:
        lines.append(f"KV sinks      the first {info['kv_sink_tokens']} positions of each "
                     "sequence unrounded, beside the pool: "
                     f"{info['kv_sink_bytes_per_sequence']} bytes a sequence")
    if info["kv_tail_bytes_per_sequence"]:
        lines.append(f"KV tails      keys scaled per block of {info['kv_block_size']}: the "
                     "block each sequence fills waits unrounded beside the pool, "
                     f"{info['kv_tail_bytes_per_sequence']} bytes a sequence")
    lines += _weight_lines(info["weights"]) + _speculative_lines(info["speculative"])
    lines += _tokenizer_lines(info["tokenizer"], info["generation"])
    lines.append(f"passes        {len(info['passes'])}")
    for report in info["passes"]:
        summary = {k: v for k, v in report.items()
                   if k not in ("name", "config") and not isinstance(v, dict | list)}
        lines.append(f"  {report['name']}: {report.get('config')}")
        lines.append(f"    {summary}")
        if report.get("quality"):
            lines.append(f"    quality: {report['quality']}")
    return "\n".join(lines)


def _weight_lines(weights: dict[str, Any]) -> list[str]:
    if not weights["quantized"]:
        return [f"weights       {weights['storage']} (no weight quantization)"]
    lines = []
    for q in weights["quantized"]:
        scheme = (f"int{q['bits']}" if q["bits"] else "integer") + (
            f", groups of {q['group_size']}" if q["group_size"] else "") + (
            "" if q["symmetric"] is None else
            ", symmetric" if q["symmetric"] else ", asymmetric")
        if q.get("format") == "nf4":  # a code book: no integer zero points
            scheme = (f"nf4, blocks of {q['group_size']}"
                      + (", double-quantized absmax" if q.get("double_quant") else ""))
        size = (f", {q['bytes'] / _MIB:.1f} MiB vs {q['float32_bytes'] / _MIB:.1f} MiB float32"
                if q["bytes"] and q["float32_bytes"] else "")
        head = "LM head included" if q["lm_head"] else "LM head float"
        lines.append(f"weights       {q['pass']}: {scheme}; {q['linears']} linears ({head})"
                     f"{size}; other weights {weights['storage']}")
    return lines


def _speculative_lines(spec: dict[str, Any] | None) -> list[str]:
    if spec is None:
        return []
    drafts = []
    if spec.get("ngram"):
        drafts.append(f"ngram (n {spec['ngram']['min_n']}-{spec['ngram']['max_n']})")
    if spec.get("model"):
        model = spec["model"]
        drafts.append(f"draft model ({model['kind']}, vocab {model['vocab_size']})")
    line = (f"speculative   {' + '.join(drafts) or 'none'}, γ {spec['gamma']}, "
            f"up to batch {spec['max_batch_size']}")
    if spec.get("predicted_speedup"):
        line += f", predicted {spec['predicted_speedup']:.2f}x at batch 1"
    lines = [line]
    if spec.get("acceptance"):
        alphas = " ".join(f"{a:.2f}" for a in spec["acceptance"])
        lines.append(f"  α           {alphas} (acceptance at each draft position)")
    return lines


def _tokenizer_facts(manifest: Manifest) -> dict[str, Any]:
    spec = manifest.tokenizer
    return {**spec.model_dump(exclude={"chat_template", "template_tokens"}),
            "chat_template": spec.chat_template is not None,
            "eos_token_ids": manifest.model.eos_token_ids, "summary": spec.summary()}


def _tokenizer_lines(tokenizer: dict[str, Any], generation: dict[str, Any]) -> list[str]:
    lines = [f"tokenizer     {tokenizer['summary']}"]
    if tokenizer.get("kind"):
        lines.append(f"  kind        {tokenizer['kind']}")
    if tokenizer.get("source"):
        lines.append(f"  source      {tokenizer['source']}")
    lines.append(f"  stops at    EOS ids {tokenizer['eos_token_ids']}")
    defaults = ", ".join(f"{k} {v}" for k, v in generation.items()) or "none"
    lines.append(f"  defaults    {defaults}")
    lines += [f"  note        {note}" for note in tokenizer.get("notes", [])]
    return lines


def _native_step(name: str, graph: GraphSpec, manifest: Manifest) -> str:
    """Whether `--kernels native` runs this graph here, or why not."""
    kv_cache = {g.name: g.kv_cache for g in manifest.runnable_graphs()}[name]
    reason = unavailable_reason(graph, kv_cache)
    return "runs here (--kernels native)" if reason is None else f"no: {reason}"
