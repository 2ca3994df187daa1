"""Writing an artifact: atomic, replacing only artifacts, every file hashed."""

from __future__ import annotations

import json

import pytest

from llmopt.compiler.artifact import staging_directory
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime.artifact import ArtifactError, load_manifest


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact") / "tiny"
    compile_recipe(Recipe(model=str(tiny_checkpoints["llama"])), out, log=lambda _: None)
    return out


def test_the_manifest_hashes_every_file(artifact):
    manifest = load_manifest(artifact)
    written = {p.name for p in artifact.iterdir()} - {"manifest.json"}
    assert set(manifest.files) == written


def test_a_changed_file_is_refused(artifact, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in artifact.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "tokenizer.json").write_text(json.dumps({"changed": True}))
    with pytest.raises(ArtifactError, match="sha256 of tokenizer.json"):
        load_manifest(copy)


def test_a_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staging_directory(out) as staging:
        (staging / "partial").write_text("x")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_an_artifact_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="is not an llmopt artifact"), \
            staging_directory(out) as staging:
        (staging / "manifest.json").write_text("{}")
    assert (out / "notes.txt").read_text() == "keep"
