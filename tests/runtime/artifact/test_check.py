"""A manifest edited against its own graphs is refused at load, naming the field.

Each case copies a compiled tiny artifact, changes one manifest field as a person or a
broken tool might, and expects the exact one-line error `load_manifest` raises (before
any ONNX Runtime session exists).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime.artifact import ArtifactError, load_manifest


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("check") / "tiny"
    recipe = Recipe.model_validate({"model": str(tiny_checkpoints["llama"]),
                                    "runtime": {"max_context": 64}})
    compile_recipe(recipe, out, log=lambda _: None)
    return out


def edited(artifact: Path, tmp_path: Path, change: Callable[[dict], None]) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    change(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def first_key(manifest: dict) -> dict:
    return manifest["kv_cache"]["layers"][0]["tensors"][0]


CASES = {
    "num_layers": (lambda m: m["model"].update(num_layers=29),
                   "manifest model.num_layers is 29 but the graph takes the KV cache of 3 "
                   "layers"),
    "vocab_size": (lambda m: m["model"].update(vocab_size=1000),
                   "manifest model.vocab_size is 1000 but the graph's logits are 256 wide"),
    "max_position": (lambda m: m["model"].update(max_position=100000),
                     "manifest model.max_position is 100000 but the graph's rotary table "
                     "rope.global.cos covers 64 positions"),
    "eos_token_ids": (lambda m: m["model"].update(eos_token_ids=[2, 99999]),
                      "manifest model.eos_token_ids[1] is 99999, outside the vocabulary "
                      "[0, 256)"),
    "tokenizer_unlisted": (lambda m: m["files"].pop("tokenizer.json"),
                           "tokenizer.json is not in the manifest's files, so its sha256 "
                           "cannot be checked"),
    "file_missing": (lambda m: m["files"].update({"extra.bin": "0" * 64}),
                     "extra.bin is missing"),
    "slot_shape": (lambda m: first_key(m).update(slot_shape=[2, 8]),
                   "manifest kv_cache: past.0.key has shape [batch, 2, capacity, 8] but "
                   "the graph takes [batch, 2, capacity, 16]"),
    "kv_dtype": (lambda m: first_key(m).update(dtype="float16"),
                 "manifest kv_cache: past.0.key is float16 but the graph takes float32"),
    "kv_tensor_renamed": (lambda m: first_key(m).update(name="keys"),
                          "manifest kv_cache lists past.0.keys but the graph has no such "
                          "input"),
    "kv_layer_removed": (lambda m: m["kv_cache"]["layers"].pop(),
                         "manifest kv_cache.layers lists 2 layers but the graph takes the KV "
                         "cache of 3"),
    "key_removed": (lambda m: m["model"].pop("vocab_size"),
                    "manifest.json: model.vocab_size: Field required"),
}


def test_the_tiny_artifact_loads(artifact):
    manifest = load_manifest(artifact)
    assert (manifest.model.num_layers, manifest.model.vocab_size) == (3, 256)


@pytest.mark.parametrize("case", CASES)
def test_a_manifest_edit_is_named(artifact, tmp_path, case):
    change, message = CASES[case]
    broken = edited(artifact, tmp_path, change)
    with pytest.raises(ArtifactError) as info:
        load_manifest(broken)
    assert str(info.value) == f"corrupt artifact {broken}: {message}"
    assert "\n" not in str(info.value)


def test_a_draft_graph_is_checked_too(tiny_checkpoints, tmp_path):
    """The toy artifact's draft is its target graph again: a draft vocab that disagrees."""
    from toy_artifact import add_draft, build_artifact

    directory = add_draft(build_artifact(tmp_path / "toy"), gamma=2)
    load_manifest(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["speculative"]["model"]["vocab_size"] = 65
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=re.escape(
            "manifest speculative.model.vocab_size is 65 but the graph's logits are 64 wide")):
        load_manifest(directory)
