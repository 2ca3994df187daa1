"""Does an AMX tile multiply overlap with AVX-512 float work on this CPU? (#14)

The native step's AMX projections spend each block of 32 activation columns on tile work
(zero, two loads, one TDPBSSD, one store of the sums) and on the float sum the block's scales
need (per row: load, convert, scale product, FMA). Where the two overlap, a block costs about
the larger of the two; where they do not, their sum, and no tile scheduling can beat that.
This builds benchmarks/probes/probe_amx_overlap.c with the system C compiler, runs each variant
(see the C file's comment) --rounds times, interleaved, and reports median ns per block tile
(16 rows x 16 columns x 32: 8,192 multiply-adds; the wide- variants: a block of
128 columns at sixteen rows, with its weights unpacked as a batch-16 step does) and what the
medians imply.

    python benchmarks/probes/probe_amx_overlap.py [--rounds 5] [--reps 20000]

Prints a table; writes benchmarks/results/probe_amx_overlap.json. Exits with a message on a
CPU (or kernel) without AMX int8 tiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common and the benchmarks
from _common import RESULTS_DIR, machine_info, run_c_probe, write_json  # noqa: E402

SOURCE = Path(__file__).with_name("probe_amx_overlap.c")
FLAGS = ["-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mgfni",
         "-mamx-tile", "-mamx-int8"]
MACS = 16 * 16 * 32
WIDE_MACS = 16 * 16 * 128  # the wide- variants' block tile: a block of 128 columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20000,
                        help="passes over the 18 blocks per variant and round")
    args = parser.parse_args()
    rounds = run_c_probe(SOURCE, FLAGS, args.reps, args.rounds,
                         "this CPU (or kernel) grants no AMX int8 tiles: nothing to probe")
    ns = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    print(f"{'variant':<14} {'ns / block tile':>16} {'GMAC/s':>8}   (median of {args.rounds})")
    for name, value in ns.items():
        macs = WIDE_MACS if name.startswith("wide-") else MACS
        print(f"{name:<14} {value:16.2f} {macs / value:8.1f}")
    overlap = {"tiles+sums": overlap_of(ns, "tiles+sums", ("tiles", "sums")),
               "wide-all": overlap_of(ns, "wide-all", ("wide-tiles", "wide-unpack", "wide-sums"))}
    print()
    for name, (serial, overlapped, share) in overlap.items():
        print(f"{name} {ns[name]:.2f} ns against {serial:.2f} if serial and {overlapped:.2f} "
              f"if fully overlapped: {100 * share:.0f} % of the overlap")
    write_json(RESULTS_DIR / "probe_amx_overlap.json",
               {"machine": machine_info(), "rounds": args.rounds, "reps": args.reps,
                "ns_per_block_tile": ns, "samples": rounds,
                "overlap": {name: {"serial_ns": serial, "overlapped_ns": overlapped,
                                   "overlap_share": share}
                            for name, (serial, overlapped, share) in overlap.items()}})


def overlap_of(ns: dict[str, float], together: str,
               parts: tuple[str, ...]) -> tuple[float, float, float]:
    """The parts' serial and fully overlapped times, and the share of that overlap the
    combined variant reaches (0: it costs their sum; 1: the largest part's time)."""
    serial = sum(ns[part] for part in parts)
    overlapped = max(ns[part] for part in parts)
    return serial, overlapped, (serial - ns[together]) / (serial - overlapped)


if __name__ == "__main__":
    main()
