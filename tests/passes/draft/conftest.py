"""Fixtures of the draft pass tests (helpers importable by name: importlib mode)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from draft_helpers import SUBSET_TOKENS, save_draft  # noqa: E402
from tiny_checkpoints import build_tiny_checkpoint  # noqa: E402

from llmopt.compiler.loader import load_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("target") / "llama")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_checkpoint(str(target_dir))


@pytest.fixture(scope="module")
def subset_dir(tmp_path_factory) -> Path:
    return save_draft(tmp_path_factory.mktemp("subset") / "d", SUBSET_TOKENS,
                      len(SUBSET_TOKENS) + 2)
