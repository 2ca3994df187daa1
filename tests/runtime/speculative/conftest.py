"""Put this directory on sys.path so tests can import each other's helpers (importlib mode)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
