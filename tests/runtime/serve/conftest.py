"""Put this directory on sys.path so tests can `import runtime_fakes` (importlib mode)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
