"""#14's batch-scaling line measured in pairs: batch 16's aggregate over batch 1's, each
batch-16 run right after a batch-1 run in the same process, so both meet the same machine
phase. bench_int4.py runs all of a system's batch sizes in one worker, one after another, and
divides medians over rounds: on a VM whose memory speed swings within seconds, batch 1
(bound by memory) and batch 16 (bound by compute) can land in different phases, and that
ratio then swings widely on one build.

    python benchmarks/batch_scaling_pairs.py ART [--threads 1] [--pairs 9] [--old OLD.so]

Each pair: run_bench at batch 1, then at batch 16 (prompt 128, generate 128, greedy, as
bench_int4), after one warm-up of each. With --old, a second build of the native kernels
(native_kernels_ab.py's load_build) runs its pair next to the installed build's, the order
reversed every pair. Prints each build's median ratio over the pairs, their range and the
median aggregates; writes benchmarks/results/batch_scaling_pairs.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _common import RESULTS_DIR, machine_info, write_json
from native_kernels_ab import engine_on, load_build

from llmopt.runtime import LLM
from llmopt.runtime.native.library import kernels
from llmopt.tools.bench import run_bench

PROMPT_LEN, GEN_LEN, WARMUP_GEN_LEN = 128, 128, 8
BATCHES = (1, 16)


def pair(llm: LLM, seed: int) -> dict[str, float]:
    """Aggregate tok/s at batch 1, then at batch 16, and their ratio."""
    aggregate = {b: run_bench(llm, b, PROMPT_LEN, GEN_LEN, seed=seed + b).aggregate_tok_s
                 for b in BATCHES}
    return {"batch1_tok_s": aggregate[1], "batch16_tok_s": aggregate[16],
            "ratio": aggregate[16] / aggregate[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--old", help="another build's shared library, run beside the installed")
    args = parser.parse_args()
    libs = {"installed": kernels()}
    if args.old:
        libs["old"] = load_build(args.old)
    # the context bench_int4's worker sizes its engine for (prompt + generation + 1)
    llms = {build: engine_on(args.artifact, lib, args.threads, PROMPT_LEN + GEN_LEN + 1)
            for build, lib in libs.items()}
    for llm in llms.values():
        for b in BATCHES:
            run_bench(llm, b, PROMPT_LEN, WARMUP_GEN_LEN, seed=b)
    pairs: dict[str, list[dict[str, float]]] = {build: [] for build in llms}
    for index in range(args.pairs):
        order = list(llms) if index % 2 == 0 else list(llms)[::-1]
        for build in order:
            pairs[build].append(pair(llms[build], seed=100 * (index + 1)))
    summary = {}
    for build, runs in pairs.items():
        ratios = [r["ratio"] for r in runs]
        summary[build] = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
                          "max_ratio": max(ratios),
                          **{f"median_{key}": statistics.median(r[key] for r in runs)
                             for key in ("batch1_tok_s", "batch16_tok_s")}}
        s = summary[build]
        print(f"{build:<10} batch 16 / batch 1: median {s['median_ratio']:.2f}x "
              f"(pairs {s['min_ratio']:.2f}-{s['max_ratio']:.2f}); aggregate tok/s batch 1 "
              f"{s['median_batch1_tok_s']:.1f}, batch 16 {s['median_batch16_tok_s']:.1f}")
    write_json(RESULTS_DIR / "batch_scaling_pairs.json",
               {"machine": machine_info(), "artifact": str(args.artifact), "old": args.old,
                "threads": args.threads, "pairs": pairs, "summary": summary})


if __name__ == "__main__":
    main()
