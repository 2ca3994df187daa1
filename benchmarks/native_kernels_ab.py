"""Two builds of the native kernels on one artifact, in one process: the step shapes that
matter, timed interleaved, so machine drift between runs does not enter the ratio.

    cp runtime/native/_kernels*.so /tmp/old.so      # before editing kernels.c
    pip install -e . --no-deps --no-build-isolation  # rebuild the edited kernels
    python benchmarks/native_kernels_ab.py ART --old /tmp/old.so [--threads 1] [--rounds 15]
    python benchmarks/native_kernels_ab.py ART --old amx-off    # the installed build, AMX off

The new build is the installed one (`--old amx-off`: "old" is the installed build with its
AMX tiles turned off, "new" with them on, where the CPU has them). Steps (executor calls on
prepared batches, nothing sampled): batch 1 with 1/2/4/8 tokens at context 128 (a decode
step and speculation's verifications), batch 4 × 8 tokens, batch 16 × 1 token at context
192, a prefill of 4 × 128 tokens. Prints median ms and new / old; writes
benchmarks/results/native_kernels_ab.json. First it checks that the builds compute the same
numbers, bit for bit (same_outputs: log-probs, batch-16 greedy tokens, lanes), which a
change that only makes the step faster must keep; it prints what differs.

Where an engine's weights land in memory moves its steps by a few per cent, either way,
so each build runs as two engines, built old, new, new, old, and a build's time is the
median over both.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import numpy as np
from _common import RESULTS_DIR, machine_info, write_json

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.executors import native as native_executor
from llmopt.runtime.executors.step_batch import SequenceStep, StepBatch, make_step_batch
from llmopt.runtime.native.library import amx_available, declare_signatures, default_knobs, kernels
from llmopt.tools.bench import bench_prompts


def load_build(path: str) -> ctypes.CDLL:
    """Another build of the kernels, with the ctypes signatures of the functions it has. Its
    structs must be this build's (runtime/native/library.py) up to its last field: fields
    added at the end (Model's knobs) are ignored by a build that predates them."""
    lib = declare_signatures(ctypes.CDLL(path))
    # A build from before per-model knobs keeps one AMX switch for the process, off until
    # asked: it follows the installed build's default, or the A/B would time AMX against VNNI.
    if hasattr(lib, "llmopt_native_amx"):
        lib.llmopt_native_amx(int(default_knobs().amx))
    return lib


def engine_on(artifact: Path, lib: ctypes.CDLL, threads: int, max_context: int = 1024,
              amx: bool | None = None) -> LLM:
    """An LLM whose native executor calls `lib` (the executor takes its library at build),
    its model on AMX tiles or not where `amx` says (None: the default)."""
    installed = native_executor.kernels
    native_executor.kernels = lambda: lib
    try:
        llm = LLM(artifact, num_threads=threads, kernels="native", speculative=False,
                  max_num_seqs=16, max_context=max_context)
    finally:
        native_executor.kernels = installed
    if amx is not None:
        llm.engine.executor.weights.use_amx(amx)
    return llm


def step_batches(llm: LLM) -> dict[str, StepBatch]:
    config = llm.engine.config
    size, lane_blocks = config.block_size, config.max_context // config.block_size

    def lane(index: int) -> list[int]:  # lane i's blocks (block 0 is the null block)
        return list(range(1 + index * lane_blocks, 1 + (index + 1) * lane_blocks))

    def tokens(q: int) -> list[int]:
        return [100 + i for i in range(q)]

    batches = {f"batch 1, {q} token(s), context 128": make_step_batch(
        [SequenceStep(tokens(q), 128, lane(0), range(q))], size) for q in (1, 2, 4, 8)}
    batches["batch 4 x 8 tokens, context 128"] = make_step_batch(
        [SequenceStep(tokens(8), 128, lane(i), range(8)) for i in range(4)], size)
    batches["batch 16 x 1 token, context 192"] = make_step_batch(
        [SequenceStep([100], 192, lane(i), [0]) for i in range(16)], size)
    rng = np.random.default_rng(0)
    batches["prefill 4 x 128 tokens"] = make_step_batch(
        [SequenceStep([int(t) for t in rng.integers(100, 40000, 128)], 0, lane(i), [127])
         for i in range(4)], size)
    return batches


def same_outputs(artifact: Path, libs: dict[str, ctypes.CDLL], amx_ab: bool,
                 threads: int) -> dict[str, bool]:
    """Whether the two builds give the same numbers, bit for bit, on fresh engines: the
    log-probs of 700 random tokens (prefill chunks, then attention over real keys) and the
    greedy tokens of 16 sequences decoded together (the batch-16 step), and the lanes they
    leave. A kernel change that only reorders work must keep all three."""
    llms = {build: engine_on(artifact, lib, threads, amx=(build == "new") if amx_ab else None)
            for build, lib in libs.items()}
    vocab = llms["new"].manifest.model.vocab_size
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, vocab, 700)]
    prompts = bench_prompts(vocab, 16, 100, 3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    scores, generated = {}, {}
    for build, llm in llms.items():
        scores[build] = llm.score(tokens)
        generated[build] = [output.token_ids for output in llm.generate(prompts, params)]
    pools = [llm.engine.executor.pools for llm in llms.values()]
    return {"log_probs": bool(np.array_equal(scores["old"], scores["new"])),
            "greedy_tokens": generated["old"] == generated["new"],
            "lanes": all(np.array_equal(pools[0][name], pools[1][name]) for name in pools[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--old", required=True, help="the other build's shared library")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    amx_ab = args.old == "amx-off"
    if amx_ab and not amx_available():
        raise SystemExit("--old amx-off: this CPU (or kernel) has no AMX int8 tiles")
    libs = {"old": kernels() if amx_ab else load_build(args.old), "new": kernels()}
    same = same_outputs(args.artifact, libs, amx_ab, args.threads)
    print("bit for bit the same: " + ", ".join(f"{k} {v}" for k, v in same.items()))
    engines = [(build, engine_on(args.artifact, libs[build], args.threads,
                                 amx=(build == "new") if amx_ab else None))
               for build in ("old", "new", "new", "old")]
    batches = step_batches(engines[0][1])
    seconds: dict[str, dict[str, list[float]]] = {k: {"old": [], "new": []} for k in batches}
    for round_ in range(args.rounds):
        for name, batch in batches.items():
            for build, llm in engines if round_ % 2 else engines[::-1]:
                started = time.perf_counter()
                llm.engine.executor.execute(batch)
                if round_ >= 2:  # the first two rounds warm up
                    seconds[name][build].append(time.perf_counter() - started)
    rows = []
    for name, times in seconds.items():
        old, new = (1000 * statistics.median(times[b]) for b in ("old", "new"))
        rows.append({"step": name, "old_ms": old, "new_ms": new, "new_over_old": new / old})
        print(f"{name:<36} old {old:8.2f} ms   new {new:8.2f} ms   new/old {new / old:.3f}")
    write_json(RESULTS_DIR / "native_kernels_ab.json",
               {"machine": machine_info(), "artifact": str(args.artifact),
                "old": args.old, "threads": args.threads, "rounds": args.rounds,
                "same_outputs": same, "rows": rows})


if __name__ == "__main__":
    main()
