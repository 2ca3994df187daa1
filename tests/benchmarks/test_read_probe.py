"""benchmarks/probes/probe_read_rate.c, the read-bandwidth probe of _bandwidth_bound.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "probe_read_rate.c"
COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_the_bandwidth_probe_reads_every_byte(tmp_path):
    """Its read ORs every word of its range: a bit set in any one chunk, including each
    thread's first and last, shows, at 1, 2 and 3 threads (the probe's own check)."""
    binary = tmp_path / "probe_read_rate"
    subprocess.run([COMPILER, "-O2", "-fopenmp", "-o", str(binary), str(PROBE)], check=True)
    printed = subprocess.run([str(binary), "check"], capture_output=True, text=True).stdout
    if printed.strip() == "unsupported":
        pytest.skip("this CPU lacks AVX-512")
    assert printed.strip() == "check ok"
