"""Put this directory on sys.path so tests can `import runtime_fakes` (importlib mode); the
official client of a module's `server` fixture."""

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture()
def client(server) -> openai.OpenAI:
    """The official client of the module's live `server` (base URL, server)."""
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)
