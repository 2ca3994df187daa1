"""The native step against ONNX Runtime on other model families (issue 14: an artifact the
native step cannot run falls back to ONNX Runtime, slower than llama.cpp on the same model).

    python benchmarks/bench_native_families.py [--families qwen2.5-0.5b,qwen3-0.6b,llama-0.5b]
        [--rounds 2] [--threads 1] [--out-dir out/families]

Each family is a checkpoint of random weights in a real model's shape (tests/tiny_checkpoints.py's
initialisation, scaled so greedy decoding does not loop on one token), compiled once under
--out-dir to int4 (`rtn` sym g32, 8-bit head, accuracy level 4). Per round, interleaved, each
artifact runs batch 1 and batch 8 (prompt 128, gen 64, random ids: `llmopt.tools.bench.run_bench`)
with `--kernels native` and `onnxruntime` in one process each; the table gives medians and the
native / ONNX Runtime ratios, and how far the two kernels' log-probs of 200 random tokens lie
apart (the same int8-activation arithmetic, summed in other orders: `llama-0.5b`, Qwen2.5's
shape without biases, is the baseline for that spread). Writes
benchmarks/results/bench_native_families.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json

from llmopt.runtime import LLM
from llmopt.tools.bench import run_bench

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (model_type, config fields)
    "qwen2.5-0.5b": ("qwen2", QWEN25_05B),  # q/k/v biases
    "qwen3-0.6b": ("qwen3", {**QWEN25_05B, "hidden_size": 1024, "intermediate_size": 3072,
                             "num_hidden_layers": 28, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "head_dim": 128}),  # head norms
    "llama-0.5b": ("llama", {k: v for k, v in QWEN25_05B.items() if k != "rope_parameters"}),
}
RECIPE_PASSES = [{"rtn": {"bits": 4, "group_size": 32, "symmetric": True,
                          "include_lm_head": True, "lm_head_bits": 8}}]
KERNELS = ("native", "onnxruntime")
BATCHES, PROMPT_LEN, GEN_LEN = (1, 8), 128, 64


def build(name: str, out_dir: Path) -> Path:
    """The family's int4 artifact under out_dir (checkpoint and compile on first use)."""
    artifact = out_dir / name / "int4"
    if (artifact / "manifest.json").exists():
        return artifact
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # the tests' random checkpoints
    from tiny_checkpoints import build_tiny_checkpoint

    from llmopt.compiler.pipeline import compile_recipe
    from llmopt.compiler.recipe import Recipe

    arch, fields = FAMILIES[name]
    source = build_tiny_checkpoint(arch, out_dir / name / "hf", overrides=fields)
    recipe = Recipe(model=str(source), passes=RECIPE_PASSES,
                    target={"nbits_accuracy_level": 4}, quality={"measure": False},
                    runtime={"max_context": 512})
    compile_recipe(recipe, artifact, log=lambda line: print(f"  {name}: {line}", flush=True))
    return artifact


def timed(artifact: Path, kernels: str, threads: int, seed: int) -> dict[int, dict[str, float]]:
    """Batch 1 and 8 on a fresh engine: TTFT, per-stream decode and aggregate tok/s."""
    llm = LLM(artifact, kernels=kernels, num_threads=threads, max_num_seqs=max(BATCHES),
              speculative=False)
    if not llm.kernels_in_use().startswith(kernels):
        raise SystemExit(f"{artifact}: asked for {kernels}, runs {llm.kernels_in_use()}")
    results = {}
    for batch in BATCHES:
        run_bench(llm, batch, PROMPT_LEN, 8, seed=seed + 100)  # warm-up
        r = run_bench(llm, batch, PROMPT_LEN, GEN_LEN, seed=seed)
        results[batch] = {"ttft_ms": r.ttft_ms, "decode_tok_s": r.decode_tok_s_per_stream,
                          "aggregate_tok_s": r.aggregate_tok_s}
    del llm
    gc.collect()
    return results


def agreement(artifact: Path, threads: int) -> dict[str, float]:
    """|native - ONNX Runtime| over the log-probs of 200 random tokens."""
    tokens = [int(t) for t in np.random.default_rng(3).integers(100, 150000, 200)]
    scores = {k: LLM(artifact, kernels=k, num_threads=threads, speculative=False).score(tokens)
              for k in KERNELS}
    gap = np.abs(scores["native"] - scores["onnxruntime"])
    return {"mean": float(gap.mean()), "max": float(gap.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "out" / "families")
    args = parser.parse_args()
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown family {unknown[0]!r}: one of {', '.join(FAMILIES)}")
    artifacts = {name: build(name, args.out_dir) for name in names}
    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict[int, dict[str, float]]]] = {}
    for rnd in range(args.rounds):
        for name, artifact in artifacts.items():
            for kernels in KERNELS if rnd % 2 == 0 else KERNELS[::-1]:
                runs.setdefault((name, kernels), []).append(
                    timed(artifact, kernels, args.threads, seed=rnd))
                print(f"round {rnd + 1} {name} {kernels}: {runs[(name, kernels)][-1]}",
                      flush=True)
    rows = []
    print(f"\n{args.threads} thread(s), medians of {args.rounds} rounds (prompt {PROMPT_LEN}, "
          f"gen {GEN_LEN}, random ids); native / onnxruntime\n")
    print("| family | batch | TTFT ms | decode tok/s/stream | aggregate tok/s |")
    print("|---|---|---|---|---|")
    for name in names:
        for batch in BATCHES:
            med = {k: {m: statistics.median(r[batch][m] for r in runs[(name, k)])
                       for m in ("ttft_ms", "decode_tok_s", "aggregate_tok_s")} for k in KERNELS}
            n, o = med["native"], med["onnxruntime"]
            rows.append({"family": name, "batch": batch, **{f"{k}_{m}": v for k in KERNELS
                                                            for m, v in med[k].items()}})
            print(f"| {name} | {batch} | {n['ttft_ms']:.0f} / {o['ttft_ms']:.0f} | "
                  f"{n['decode_tok_s']:.1f} / {o['decode_tok_s']:.1f} "
                  f"({n['decode_tok_s'] / o['decode_tok_s']:.2f}x) | "
                  f"{n['aggregate_tok_s']:.1f} / {o['aggregate_tok_s']:.1f} "
                  f"({n['aggregate_tok_s'] / o['aggregate_tok_s']:.2f}x) |")
    gaps = {name: agreement(artifact, args.threads) for name, artifact in artifacts.items()}
    print("\nlog-probs of 200 random tokens, |native - onnxruntime|: " + ", ".join(
        f"{name} mean {g['mean']:.2f} max {g['max']:.2f}" for name, g in gaps.items()))
    write_json(RESULTS_DIR / "bench_native_families.json", {
        "machine": machine_info(), "threads": args.threads, "rounds": args.rounds,
        "families": {n: FAMILIES[n] for n in names}, "rows": rows, "agreement": gaps,
        "runs": {f"{n}/{k}": v for (n, k), v in runs.items()},
        "total_s": time.perf_counter() - started})


if __name__ == "__main__":
    main()
