"""Shared fixtures: tiny random checkpoints of every supported architecture."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

# Test helper modules (tiny_checkpoints) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_checkpoints import (  # noqa: E402
    TINY_CONFIGS,
    build_family_checkpoint,
    build_tiny_checkpoint,
)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """arch name -> directory of a saved tiny random checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, root / arch) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """arch -> {"hf": directory, "gguf": file}: the same tiny random weights with a
    tokenizer of the family's real kind (specials, BOS rule, chat template), both forms."""
    root = tmp_path_factory.mktemp("family")
    return {arch: build_family_checkpoint(arch, root / arch) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def word_text(tmp_path_factory) -> Path:
    """A calibration/evaluation text file of 4000 words drawn from ten (seeded)."""
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(4000)))
    return path


@pytest.fixture(scope="session")
def tool_artifact(tmp_path_factory) -> Path:
    """A tiny Qwen2 artifact with Qwen2.5's tool-capable template and an n-gram draft
    (tiny_tool_artifact.py); its checkpoint is in the folder beside it."""
    from tiny_tool_artifact import build_tool_artifact

    return build_tool_artifact(tmp_path_factory.mktemp("tools"))
