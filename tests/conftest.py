"""Shared fixtures: tiny random checkpoints of every supported architecture."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Test helper modules (tiny_checkpoints) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_checkpoints import TINY_CONFIGS, build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """arch name -> directory of a saved tiny random checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, root / arch) for arch in TINY_CONFIGS}
