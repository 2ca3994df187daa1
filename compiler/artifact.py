"""Write the artifact directory atomically: graphs, weights, tokenizer, manifest.

Everything is written into a temporary sibling directory and renamed into place at
the end, so a failed compile never leaves something that looks like an artifact.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.lower import LoweredGraph
from llmopt.compiler.onnx_graph import save_with_external_data
from llmopt.compiler.preflight import check_output_directory
from llmopt.compiler.recipe import Recipe, resolved_dict
from llmopt.runtime.artifact import sha256_file
from llmopt.runtime.contract import FORMAT_VERSION
from llmopt.runtime.manifest import MANIFEST_FILE, Manifest, SpeculativeSpec

TOKEN_MAP_FILE = "draft_token_map.npy"
NGRAM_CORPUS_FILE = "draft_ngram_corpus.npy"

_TOOLS = ("llmopt", "torch", "transformers", "onnx", "onnxruntime", "tokenizers")


@contextmanager
def staging_directory(out: Path) -> Iterator[Path]:
    """Yield a temp dir beside `out`; on success it replaces `out`, on error it vanishes."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; an artifact is meant to be shared
    try:
        yield staging
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace(staging: Path, out: Path) -> None:
    check_output_directory(out)
    if out.exists():
        trash = out.with_name(f".{out.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(out, trash)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)


def write_artifact(
    directory: Path,
    ir: ModelIR,
    graphs: dict[str, LoweredGraph],
    recipe: Recipe,
    pass_reports: list[dict[str, Any]],
) -> Manifest:
    """Write the lowered graphs ("target", and "draft" when the IR pairs a draft model),
    tokenizer and manifest into `directory`."""
    graph_specs = {name: save_graph(lowered, directory / f"{name}.onnx")
                   for name, lowered in graphs.items()}
    for file, content in ir.tokenizer_files.items():
        (directory / file).write_bytes(content)
    speculative = _speculative_spec(directory, ir, recipe, graphs.get("draft"))
    for file in directory.iterdir():
        file.chmod(0o644)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model=_model_spec(ir, recipe),
        graphs=graph_specs,
        kv_cache=graphs["target"].kv_cache,
        runtime=recipe.runtime.model_dump(),
        tokenizer=_tokenizer_spec(ir),
        generation=ir.generation_defaults,
        speculative=speculative,
        files={p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()},
        ir=_ir_record(ir),
        recipe=resolved_dict(recipe),
        passes=pass_reports,
        tools=tool_versions(),
    )
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest.model_dump(), indent=2))
    return manifest


def _speculative_spec(directory: Path, ir: ModelIR, recipe: Recipe,
                      draft: LoweredGraph | None) -> SpeculativeSpec | None:
    """The manifest's `speculative` section; writes the draft's token map beside it."""
    bundle = ir.draft
    if bundle is None:
        return None
    spec = dict(bundle.speculative)
    if bundle.ngram_corpus is not None:
        np.save(directory / NGRAM_CORPUS_FILE, np.asarray(bundle.ngram_corpus, dtype=np.int64))
        spec["ngram"] = {**spec["ngram"], "corpus": NGRAM_CORPUS_FILE}
    if bundle.ir is not None:
        token_map = None
        if bundle.token_map is not None:
            token_map = TOKEN_MAP_FILE
            np.save(directory / token_map, bundle.token_map.numpy().astype(np.int64))
        arch = bundle.ir.arch
        spec["model"] = {
            "kind": bundle.kind,
            "graph": "draft",
            "kv_cache": draft.kv_cache,
            "vocab_size": arch.vocab_size,
            "max_position": min(arch.max_position, recipe.runtime.max_context),
            "token_map": token_map,
        }
    return SpeculativeSpec.model_validate(spec)


def save_graph(lowered: LoweredGraph, path: Path) -> dict[str, Any]:
    """Write a lowered graph (weights in a file beside it) and return its manifest entry
    (`GraphSpec`'s fields), native plan included."""
    model, options = lowered.model, lowered.options
    data_file = save_with_external_data(model, path)
    return {"file": path.name, "data_file": data_file, "opset": _opset(model),
            "operator_set": options.operator_set, "nodes": len(model.graph.node),
            "nodes_per_layer": lowered.nodes_per_layer,
            "nbits_accuracy_level": options.nbits_accuracy_level,
            "native": lowered.native.resolve(model).to_manifest()}


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _model_spec(ir: ModelIR, recipe: Recipe) -> dict[str, Any]:
    arch = ir.arch
    return {
        "vocab_size": arch.vocab_size,
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "max_position": min(arch.max_position, recipe.runtime.max_context),
        "bos_token_id": arch.bos_token_id,
        "eos_token_ids": list(arch.eos_token_ids),
        "pad_token_id": arch.pad_token_id,
    }


def _tokenizer_spec(ir: ModelIR) -> dict[str, Any]:
    if ir.tokenizer_spec is not None:
        return ir.tokenizer_spec.model_dump()
    tokens = ir.annotations.get("tokens", {})  # an IR built without the loader
    return {"file": "tokenizer.json", "bos_token": tokens.get("bos_token"),
            "eos_token": tokens.get("eos_token")}


def _ir_record(ir: ModelIR) -> dict[str, Any]:
    arch = ir.arch.to_dict()
    for rope in arch["ropes"].values():
        rope["inv_freq"] = len(rope["inv_freq"])  # the table is in the graph; keep its size
    record = {"arch": arch, "source": ir.source, "parameters": ir.num_parameters()}
    if hf_config := ir.annotations.get("hf_config"):  # for `export-hf ARTIFACT`
        record["hf_config"] = json.loads(json.dumps(hf_config, default=str))
    if ir.draft is not None and ir.draft.ir is not None:
        record["draft"] = _ir_record(ir.draft.ir)
    return record


def tool_versions() -> dict[str, str]:
    versions = {}
    for tool in _TOOLS:
        try:
            versions[tool] = importlib.metadata.version(tool)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
