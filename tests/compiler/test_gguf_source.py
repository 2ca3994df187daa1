"""GGUF files read a tensor at a time: the same weights transformers' GGUF loader gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_quantized_gguf import write_tiny_gguf

from llmopt.compiler import loader
from llmopt.compiler.checkpoint_ref import resolve_checkpoint
from llmopt.compiler.gguf_source import GGUFSource
from llmopt.compiler.memory_estimate import gguf_streams, streams_weights


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The IR read lazily, and the IR transformers loads whole from the same file."""
    lazy = loader.load_checkpoint(str(path))
    with monkeypatch.context() as patch:
        patch.setattr(loader, "gguf_source", lambda *args: None)
        whole = loader.load_checkpoint(str(path))
    return lazy, whole


def _assert_same_weights(lazy, whole) -> None:
    assert isinstance(lazy.weights.source, GGUFSource)
    assert sorted(lazy.weights) == sorted(whole.weights)
    for name in whole.weights:
        # Gemma norms: transformers subtracts the 1 the IR adds back, a rounding apart
        torch.testing.assert_close(lazy.weights[name], whole.weights[name], rtol=0, atol=1e-6,
                                   msg=name)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2",
                                  "gemma3_text"])
def test_each_family_reads_as_transformers_does(arch, family_checkpoints, monkeypatch):
    lazy, whole = _both(family_checkpoints[arch]["gguf"], monkeypatch)
    _assert_same_weights(lazy, whole)
    assert lazy.arch == whole.arch


def test_quantized_blocks_dequantize_as_transformers_does(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "q.gguf", {"attn": "Q4_0", "ffn": "Q4_1", "embd": "Q8_0"})
    lazy, whole = _both(path, monkeypatch)
    _assert_same_weights(lazy, whole)


def test_loading_reads_no_tensor_and_each_access_reads_one(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf", {"attn": "Q4_0", "ffn": "Q4_1", "embd": "Q8_0"})
    ir = loader.load_checkpoint(str(path))
    source = ir.weights.source
    assert source.reads == 0
    layer = [n for n in ir.weights if n.startswith("layers.0.")]
    for name in layer:
        ir.weights[name].add_(1.0)  # a writable copy, never the mapped file
    assert source.reads == len(layer)
    assert not torch.equal(ir.weights[layer[0]] + 1.0, ir.weights[layer[0]])


def test_preflight_counts_a_gguf_file_as_streamed(tmp_path):
    path = write_tiny_gguf(tmp_path / "q.gguf", {"attn": "Q4_0", "ffn": "Q4_1", "embd": "Q8_0"})
    assert gguf_streams(path) and streams_weights(resolve_checkpoint(str(path)))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    assert not gguf_streams(tmp_path / "bad.gguf")
