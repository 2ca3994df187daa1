"""The arithmetic floor of a batched run: the int8 multiply-adds it must issue over the rate
at which this machine's cores issue them.

A batch-1 decode step is bound by reading its weights (_bandwidth_bound.py). A batch-16
decode step reads the same bytes for sixteen tokens, and a prefill for hundreds: both spend
their time in the projections' int8 dots (VPDPBUSD on int8 activations times 4-bit codes),
so their floor is the run's multiply-adds over the cores' dot rate. Counted for a native
llmopt artifact from its plan (manifest.json's `native`): every prompt token through every
projection and attention over the prompt before it, the LM head for each prompt's last
token (a prefill returns no other logits), then gen - 1 decode steps of `batch` tokens
through the projections, the head and attention over the cache. The dot rate is
benchmarks/probe_dot_rate.c's independent zmm chains (64 multiply-adds a dot), one copy per
thread run at once, so a slower second core counts as it is.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from _common import build_c_probe, probe_values

PROBE = Path(__file__).with_name("probe_dot_rate.c")
MACS_PER_ZMM_DOT = 64
PROBE_REPS = 4_000_000  # passes of 12 dots: ~15 ms a variant at 3.6 G dots a second


def dot_rate_g_macs(threads: int) -> float | None:
    """G int8 multiply-adds a second `threads` cores issue together (the sum of one probe
    per thread, run at once), or None where the probe cannot run (no C compiler, or a CPU
    without AVX-512 VNNI)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            binary = build_c_probe(PROBE, ["-O2"], Path(tmp))
        except (SystemExit, subprocess.CalledProcessError):
            return None
        probes = [subprocess.Popen([str(binary), str(PROBE_REPS)], stdout=subprocess.PIPE,
                                   text=True) for _ in range(threads)]
        outputs = [probe.communicate()[0] for probe in probes]
    if any(probe.returncode for probe in probes):
        return None
    rates = [probe_values(output) for output in outputs]
    if any("zmm" not in rate for rate in rates):
        return None
    return sum(rate["zmm"] for rate in rates) * MACS_PER_ZMM_DOT


def token_macs(plan: dict[str, Any]) -> dict[str, int]:
    """Multiply-adds one token costs: through the decoder's projections, through the LM
    head, and per cached position its attention reads (scores and weighted sums)."""
    hidden, inter = plan["hidden"], plan["intermediate"]
    q_width, kv_width = plan["heads"] * plan["head_dim"], plan["kv_heads"] * plan["head_dim"]
    per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * inter
    layers = len(plan["layers"])
    return {"projections": layers * per_layer, "head": hidden * plan["vocab"],
            "attention_per_position": layers * 2 * q_width}


def run_macs(plan: dict[str, Any], batch: int, prompt_len: int, gen_len: int) -> float:
    """Multiply-adds of a greedy run of `batch` prompts of prompt_len generating gen_len
    tokens each (see the module's docstring)."""
    macs = token_macs(plan)
    attention = macs["attention_per_position"]
    prompt_positions = prompt_len * (prompt_len + 1) / 2  # token i attends to i + 1 rows
    prefill = prompt_len * macs["projections"] + macs["head"] + attention * prompt_positions
    decode_positions = sum(prompt_len + 1 + step for step in range(gen_len - 1))
    decode = ((gen_len - 1) * (macs["projections"] + macs["head"])
              + attention * decode_positions)
    return batch * (prefill + decode)


def native_plan(artifact: Path) -> dict[str, Any] | None:
    """The target graph's native plan from an llmopt artifact's manifest, or None."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    return manifest.get("graphs", {}).get("target", {}).get("native")
