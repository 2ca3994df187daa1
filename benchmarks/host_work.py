"""The engine's host work per step alone (#14): scheduling, the step's inputs, sampling,
detokenizing and outputs, with the native kernels' call replaced by a sweep over
--sweep-mib of memory, whose time is taken out.

    python benchmarks/host_work.py ART [--batch 1,16] [--runs 9] [--sweep-mib 64]

A real step streams the weights (~70 MB for SmolLM2 int4) and the KV lanes, so the Python
that follows it finds its own objects out of every cache; the sweep leaves them there too
(--sweep-mib 0: the caches warm, the lower bound). Each run generates 128 greedy tokens
per sequence from distinct random prompts of 128 tokens (prefix caching finds nothing);
a figure is (wall - sweeps) / 128 per run, the median over runs. Prints a table; writes
benchmarks/results/host_work.json.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS_DIR, machine_info, write_json

from llmopt.runtime import LLM, SamplingParams
from llmopt.tools.bench import bench_prompts

GEN_LEN = 128


class SweepingKernels:
    """The native library with its step replaced by a write over `sweep` (timed)."""

    def __init__(self, library: Any, sweep: np.ndarray):
        self._library, self._sweep, self.seconds = library, sweep, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._library, name)

    def llmopt_forward(self, *args: Any) -> int:
        started = time.perf_counter()
        ctypes.memset(self._sweep.ctypes.data, 1, self._sweep.size)
        self.seconds += time.perf_counter() - started
        return 0


def host_ms_per_step(llm: LLM, kernels: SweepingKernels, batch: int, seed: int) -> float:
    prompts = bench_prompts(llm.manifest.model.vocab_size, batch, 128, seed)
    params = SamplingParams(max_tokens=GEN_LEN, temperature=0.0, ignore_eos=True)
    kernels.seconds = 0.0
    started = time.perf_counter()
    llm.generate(prompts, params)
    return 1000 * (time.perf_counter() - started - kernels.seconds) / GEN_LEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--sweep-mib", type=int, default=64)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(args.artifact, kernels="native", num_threads=1, speculative=False,
              max_num_seqs=max(batches), max_context=128 + GEN_LEN + 1)
    executor = llm.engine.executor
    kernels = SweepingKernels(executor._lib, np.zeros(args.sweep_mib << 20, np.uint8))
    executor._lib = kernels
    rows = []
    for batch in batches:
        host_ms_per_step(llm, kernels, batch, seed=10_000)  # warm-up
        runs = [host_ms_per_step(llm, kernels, batch, seed=run) for run in range(args.runs)]
        rows.append({"batch": batch, "host_ms_per_step": statistics.median(runs),
                     "min_ms": min(runs), "max_ms": max(runs)})
    print(f"host work per step, ms (median of {args.runs} runs of {GEN_LEN} steps; caches "
          f"{'swept over ' + str(args.sweep_mib) + ' MiB' if args.sweep_mib else 'warm'})")
    for r in rows:
        print(f"batch {r['batch']:3d}: {r['host_ms_per_step']:.3f} "
              f"({r['min_ms']:.3f}-{r['max_ms']:.3f})")
    write_json(RESULTS_DIR / "host_work.json",
               {"benchmark": "host_work", "machine": machine_info(),
                "config": {"artifact": str(args.artifact), "runs": args.runs,
                           "sweep_mib": args.sweep_mib, "gen_len": GEN_LEN},
                "rows": rows})


if __name__ == "__main__":
    main()
