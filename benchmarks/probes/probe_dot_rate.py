"""The int8 dot-product ceiling of this core, and the native step's 4-bit loop against it
(#14).

Batch-16 decode steps and prefill multiply far more than they read: their time is the int8
dots (VPDPBUSD) the projections issue. This builds benchmarks/probe_dot_rate.c with the
system C compiler and runs it --rounds times: independent zmm and ymm dot chains (the
core's issue rate), zmm dots with a broadcast operand, and the step's 4-bit slice loop
(tile8_q4's) on data in L1. Reports the median G dots a second per variant and the
multiply-adds it implies (64 a zmm dot, 32 a ymm dot).

    python benchmarks/probes/probe_dot_rate.py [--rounds 5] [--reps 8000000]

Prints a table; writes benchmarks/results/probe_dot_rate.json. Needs AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common and the benchmarks
from _common import RESULTS_DIR, machine_info, run_c_probe, write_json  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "probe_dot_rate.c"  # bench_int4 runs it too
MACS_PER_DOT = {"zmm": 64, "ymm": 32, "zmm-broadcast": 64, "slice-body": 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=8_000_000,
                        help="passes of 12 chained dots per variant and round")
    args = parser.parse_args()
    rounds = run_c_probe(SOURCE, ["-O2"], args.reps, args.rounds,
                         "the probe failed: this CPU may lack AVX-512 VNNI")
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    print(f"{'variant':<16}{'G dots/s':>10}{'G MACs/s':>10}")
    for name, rate in medians.items():
        print(f"{name:<16}{rate:10.3f}{rate * MACS_PER_DOT[name]:10.1f}")
    ceiling = medians["zmm"] * MACS_PER_DOT["zmm"]
    print(f"the 4-bit slice loop in L1: {medians['slice-body'] / medians['zmm']:.0%} of the "
          f"zmm issue rate; ceiling {ceiling:.1f} G int8 multiply-adds/s a core")
    write_json(RESULTS_DIR / "probe_dot_rate.json",
               {"machine": machine_info(), "reps": args.reps, "rounds": rounds,
                "median_g_dots_per_s": medians, "ceiling_g_macs_per_s": ceiling})


if __name__ == "__main__":
    main()
