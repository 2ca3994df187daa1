"""Where the native step's time goes, phase by phase (#14): for each step shape, the ms a
step spends in each phase of kernels.c's profile, in a layer's order (embed, qkv, kv_write,
attend, o, norms, gate_up, silu, down, head), and outside them (the executor's Python, the
step's scratch memory).

    python benchmarks/native_step_profile.py ART [--threads 1] [--rounds 9]

The step shapes are native_kernels_ab.py's (batch 1 with 1-8 tokens, batch 4 x 8, batch 16
x 1 at context 192, a 4 x 128 prefill), executed on prepared batches. Each round runs every
shape once with the profile on (a clock read either side of each phase: ~600 reads a step,
small beside even a batch-1 step); a figure is the median over rounds, after two rounds of warm-up.
Prints a table; writes benchmarks/results/native_step_profile.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _common import RESULTS_DIR, machine_info, write_json
from native_kernels_ab import engine_on, step_batches

from llmopt.runtime import LLM
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.native.library import kernels, profile_phases

WARMUP_ROUNDS = 2


def profiled_step(llm: LLM, batch: StepBatch) -> dict[str, float]:
    """One executor call with the profile on: ms per phase, 'outside' and 'step' (wall)."""
    weights = llm.engine.executor.weights
    weights.profile(True)
    started = time.perf_counter()
    llm.engine.executor.execute(batch)
    wall = time.perf_counter() - started
    weights.profile(False)
    ms = {name: 1000 * seconds for name, seconds in weights.profile_seconds().items()}
    return {**ms, "outside": 1000 * wall - sum(ms.values()), "step": 1000 * wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    lib = kernels()
    if lib is None or not lib.llmopt_native_supported():
        raise SystemExit("this install has no native kernels for this CPU: nothing to profile")
    llm = engine_on(args.artifact, lib, args.threads)
    batches = step_batches(llm)
    samples: dict[str, list[dict[str, float]]] = {step: [] for step in batches}
    for round_ in range(WARMUP_ROUNDS + args.rounds):
        for step, batch in batches.items():
            ms = profiled_step(llm, batch)
            if round_ >= WARMUP_ROUNDS:
                samples[step].append(ms)
    table = {step: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
             for step, runs in samples.items()}
    keys = [*profile_phases(lib), "outside", "step"]
    print(f"{'ms per step (median of ' + str(args.rounds) + ')':<36}"
          + "".join(f"{key:>9}" for key in keys))
    for step, ms in table.items():
        print(f"{step:<36}" + "".join(f"{ms[key]:9.3f}" for key in keys))
    write_json(RESULTS_DIR / "native_step_profile.json",
               {"machine": machine_info(), "artifact": str(args.artifact),
                "threads": args.threads, "rounds": args.rounds,
                "amx": bool(llm.engine.executor.weights.model.knobs.amx),
                "ms_per_step": table})


if __name__ == "__main__":
    main()
