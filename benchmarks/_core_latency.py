"""How far apart the cores a multi-thread run uses are: probe_core_latency.c's cache-line
round trip between two threads pinned to the first two CPUs this process may use.

A VM's host may place its vCPUs near or apart for minutes at a time, which moves a
multi-thread step and not a 1-thread one: bench_int4 runs the probe before and after every
multi-thread worker and reports the batch-16 / batch-1 ratio round by round beside it.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from _common import build_c_probe, probe_values

PROBE = Path(__file__).with_name("probe_core_latency.c")


@cache
def _binary() -> Path | None:
    """The probe, built once a process (None where it does not build)."""
    directory = Path(tempfile.mkdtemp(prefix="core-latency-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    try:
        return build_c_probe(PROBE, ["-O2", "-pthread"], directory)
    except (subprocess.CalledProcessError, SystemExit):
        return None


def core_round_trip_ns() -> float | None:
    """The round trip in ns, or None (no compiler, a failed run, a single CPU)."""
    binary = _binary()
    if binary is None:
        return None
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    if result.returncode:
        return None
    return probe_values(result.stdout).get("round_trip_ns")
