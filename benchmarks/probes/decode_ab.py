"""Decode speed of two installs side by side: `llmopt bench` from each, interleaved round
by round on one artifact, and the new/old ratio of the decode-phase aggregate per batch.

    python benchmarks/probes/decode_ab.py ART --old OLD/bin/llmopt --new NEW/bin/llmopt \
        --batch 1,16 --rounds 8

Prints a table (median ratio, its range over rounds) and writes JSON beside the other
results. Interleaving spreads the machine's load over both alike; the spread of the
ratios is the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402


def bench(llmopt: str, artifact: Path, batches: str, args: argparse.Namespace) -> dict[int, float]:
    """Decode-phase aggregate tok/s per batch size, from one `llmopt bench --json` run."""
    command = [llmopt, "bench", str(artifact), "--batch", batches, "--json",
               "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
               "--threads", str(args.threads)]
    env = {**os.environ, "LLMOPT_NATIVE_ADAPTIVE_THREADS": "0"}  # the same threads each run
    lines = subprocess.run(command, check=True, capture_output=True, text=True,
                           env=env).stdout.splitlines()
    results = [json.loads(line) for line in lines if line.startswith("{")]
    return {r["batch"]: r["decode_aggregate_tok_s"] for r in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--old", required=True, help="the old install's llmopt executable")
    parser.add_argument("--new", required=True, help="the new install's llmopt executable")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        if i % 2:
            order.reverse()  # neither install always runs first
        runs = {name: bench(exe, args.artifact, args.batch, args) for name, exe in order}
        rounds.append(runs)
        print(f"round {i + 1}: " + ", ".join(
            f"b{b} {runs['new'][b] / runs['old'][b]:.3f}" for b in runs["old"]), flush=True)
    print(f"\n{'batch':>5} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'range':>13}")
    summary = {}
    for b in rounds[0]["old"]:
        ratios = [r["new"][b] / r["old"][b] for r in rounds]
        old = statistics.median(r["old"][b] for r in rounds)
        new = statistics.median(r["new"][b] for r in rounds)
        summary[b] = {"old": old, "new": new, "ratio_median": statistics.median(ratios),
                      "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(f"{b:>5} {old:>10.1f} {new:>10.1f} {statistics.median(ratios):>8.3f} "
              f"{min(ratios):>6.3f}-{max(ratios):.3f}")
    write_json(RESULTS_DIR / "decode_ab.json",
               {"machine": machine_info(), "args": vars(args) | {"artifact": str(args.artifact)},
                "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
