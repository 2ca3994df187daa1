"""Speculation controller ablation: which of the run-time controllers earns its keep.

    python benchmarks/speculation_ablation.py \\
        --artifacts ngram=out/spec-ngram,suffix=out/spec-suffix --minutes 38

One process loads each artifact once (ONNX Runtime pinned to --threads) and runs the
fixed v2 mix (`prompts/spec_mix_v2.jsonl`), greedy, `--gen` new tokens per prompt (EOS
ignored), in batches of each `--batches` size, under every configuration of the
speculator in turn (the engine's speculator swapped, so every configuration runs on the
same executor, weights and pool; the prompts are in the prefix cache before any
configuration runs them, so decode speed is what differs). Within a round, each batch of
prompts runs under every configuration back to back, in an order rotated per batch and
round, so load swings hit them alike. Rounds repeat until `--minutes` would be exceeded
(at least `--min-rounds`).

Configurations (speculation at every batch size: the manifest's batch-size limit lifted):

- `off`: no speculator (the plain engine);
- `fixed-γ`: γ drafts for every sequence whose drafter finds some, every step;
- `fixed-γ+cap`: γ drafts each, the step's drafts trimmed to what pays for the step as a
  whole (`SpeculationPolicy.cap`: per-sequence acceptance records, the step cost model);
- `full`: the runtime's default speculator: each sequence's drafts sized by its record
  and their price (`SpeculationPolicy.num_drafts`), plus the cap.

The governor (drafts priced from the engine's step timings), the kept-share discount and
the discard/rest counters were ablated here too and removed for not winning; their
configurations (`full-governor`, `full-kept`, `full-rest`) run at the commit before.

A controller wins at a batch size when the median over rounds of the paired ratio
(tok/s with it / tok/s without it, same round) exceeds 1 by more than half the range of
those ratios, and loses by the mirror rule. Greedy outputs of every configuration are
compared with `off` (speculation is exact: they must not differ).

Prints a table and writes JSON to benchmarks/results/speculation_ablation.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, THREAD_ENV_VARS, machine_info, write_json  # noqa: E402
from bench_speculative import encode_mix, timed_generate  # noqa: E402

# (with, without) configuration pairs: what each controller adds.
CONTROLLERS = {
    "per-step cap": ("fixed+cap", "fixed"),
    "per-sequence policy": ("full", "fixed+cap"),
}
METRICS = ("decode_tokens", "decode_time", "decode_steps", "spec_steps", "draft_tokens",
           "accepted_tokens", "output_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", required=True,
                        help="Comma-separated NAME=PATH of artifacts compiled with a draft.")
    parser.add_argument("--gammas", default="",
                        help="Extra fixed γs per artifact, NAME=G[:G...] (comma-separated); "
                        "the manifest's γ always runs.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gen", type=int, default=24)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--minutes", type=float, default=38.0)
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=20)
    parser.add_argument("--configs", default="",
                        help="Comma-separated configuration names to run (default: all).")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "speculation_ablation.json")
    args = parser.parse_args()
    for var in THREAD_ENV_VARS:  # before onnxruntime/numpy start their pools
        os.environ[var] = str(args.threads)
    results = run(args)
    print_table(results)
    print(f"wrote {args.out}")


# ------------------------------------------------------------------------- configurations
def configurations(gamma: int, extra_gammas: list[int]) -> dict[str, dict[str, Any]]:
    """Name -> how to build the speculator (None: no speculation)."""
    full = {"gamma": gamma, "policy": True, "sizing": True}
    configs: dict[str, Any] = {"off": None, "fixed": {**full, "policy": False}}
    for g in [gamma, *extra_gammas]:
        configs["fixed+cap" + ("" if g == gamma else f"-{g}")] = {
            **full, "gamma": g, "sizing": False}
    configs["full"] = full
    return configs


def build(llm, config: dict[str, Any] | None, max_batch: int):
    """The speculator `config` describes, built as the runtime builds its default one and
    then stripped of the controllers it leaves out."""
    from llmopt.runtime.speculative.speculator import build_speculator

    if config is None:
        return None
    speculator = build_speculator(llm.path, llm.manifest, llm.engine.kv_cache_manager,
                                  _no_executor, gamma=config["gamma"],
                                  max_batch_size=max_batch, adaptive=config["policy"])
    policy = speculator.policy
    if policy is not None and not config["sizing"]:
        policy.num_drafts = lambda request, source=None: policy.gamma
    return speculator


def _no_executor(*args: Any) -> Any:
    raise ValueError("the ablation runs n-gram drafts only (no draft model)")


# ------------------------------------------------------------------------- the runs
def run(args: argparse.Namespace) -> dict[str, Any]:
    from llmopt.runtime import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",") if b]
    extra = {name: [int(g) for g in gs.split(":")]
             for name, gs in (item.split("=") for item in args.gammas.split(",") if item)}
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    deadline = time.monotonic() + 60 * args.minutes
    results: dict[str, Any] = {"machine": machine_info(), "threads": args.threads,
                               "gen": args.gen, "batches": batches, "artifacts": {}}
    setups = []
    for item in args.artifacts.split(","):
        name, path = item.split("=", 1)
        llm = LLM(path, num_threads=args.threads, max_num_seqs=max(batches),
                  max_context=1024)
        gamma = llm.manifest.speculative.gamma
        configs = configurations(gamma, extra.get(name, []))
        if args.configs:
            configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
        speculators = {k: build(llm, c, max(batches)) for k, c in configs.items()}
        mix = [p for ps in encode_mix(llm.tokenizer, "v2").values() for p in ps]
        llm.generate([mix[0]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        setups.append((name, llm, speculators, mix))
        results["artifacts"][name] = {
            "path": path, "gamma": gamma, "manifest_max_batch_size":
            llm.manifest.speculative.max_batch_size, "configs": configs, "rounds": []}
    started = time.monotonic()
    for round_ in range(args.max_rounds):
        elapsed = time.monotonic() - started
        if round_ >= args.min_rounds and time.monotonic() + elapsed / round_ > deadline:
            break
        for name, llm, speculators, mix in setups:
            record = {"loadavg": os.getloadavg()[0], "by_batch": {
                batch: run_batch(llm, speculators, mix, batch, params, round_)
                for batch in batches}}
            results["artifacts"][name]["rounds"].append(record)
        print(f"round {round_ + 1} done at {time.monotonic() - started:.0f} s, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        summarize(results)
        write_json(args.out, results)
    results["loadavg_at_end"] = list(os.getloadavg())
    write_json(args.out, results)
    return results


def run_batch(llm, speculators: dict[str, Any], mix: list[list[int]], batch: int, params,
              round_: int) -> dict[str, dict[str, Any]]:
    """The whole mix (cycled to a multiple of `batch`) under every configuration, each
    batch of prompts under all of them back to back, in a rotating order."""
    from llmopt.runtime import SamplingParams

    count = -(-len(mix) // batch) * batch
    cycled = (mix * (count // len(mix) + 1))[:count]
    names = list(speculators)
    totals = {name: dict.fromkeys(METRICS, 0.0) | {"token_ids": []} for name in names}
    prefill = SamplingParams(temperature=0.0, max_tokens=1)
    for index, start in enumerate(range(0, count, batch)):
        # Prompts into the prefix cache first: no configuration pays their prefill.
        llm.engine.speculator = None
        llm.generate(cycled[start : start + batch], prefill)
        shift = (round_ * 7 + index * 3) % len(names)
        for name in names[shift:] + names[:shift]:
            llm.engine.speculator = speculators[name]
            r = timed_generate(llm, cycled[start : start + batch], params)
            r["decode_time"] = r["decode_tokens"] / r["tok_s"]
            for metric in METRICS:
                totals[name][metric] += r[metric]
            totals[name]["token_ids"] += r["token_ids"]
    reference = totals.get("off", totals[names[0]])["token_ids"]
    for total in totals.values():
        total["differ"] = sum(a != b for a, b in zip(total.pop("token_ids"), reference,
                                                      strict=True))
        total["tok_s"] = total["decode_tokens"] / total["decode_time"]
    return totals


# ------------------------------------------------------------------------- the summary
def summarize(results: dict[str, Any]) -> None:
    """Per artifact, batch and configuration: medians, spreads and paired ratios."""
    for r in results["artifacts"].values():
        rounds = r["rounds"]
        table: dict[str, Any] = {}
        for batch in results["batches"]:
            runs = [record["by_batch"][batch] for record in rounds]
            names = list(runs[0])
            rows = {}
            for name in names:
                speeds = [run[name]["tok_s"] for run in runs]
                summed = {m: sum(run[name][m] for run in runs) for m in METRICS}
                rows[name] = {
                    "tok_s": statistics.median(speeds), "tok_s_range": [min(speeds),
                                                                        max(speeds)],
                    "vs_off": paired(runs, name, "off"), "vs_full": paired(runs, name, "full"),
                    "tokens_per_step": summed["output_tokens"] / summed["decode_steps"],
                    "acceptance": (summed["accepted_tokens"] / summed["draft_tokens"]
                                   if summed["draft_tokens"] else 0.0),
                    "spec_step_share": summed["spec_steps"] / summed["decode_steps"],
                    "outputs_differ": sum(run[name]["differ"] for run in runs)}
            wins = {}
            for controller, pair in CONTROLLERS.items():
                ratio = paired(runs, *pair)
                if ratio is not None:
                    wins[controller] = {"with": pair[0], "without": pair[1], **ratio,
                                        "verdict": verdict(ratio)}
            table[str(batch)] = {"configs": rows, "controllers": wins}
        r["summary"] = table
        r["num_rounds"] = len(rounds)
        r["loadavg"] = [record["loadavg"] for record in rounds]


def paired(runs: list[dict[str, Any]], name: str, other: str) -> dict[str, Any] | None:
    """Median and range over rounds of tok/s of `name` over `other` in the same round."""
    if other not in runs[0] or name not in runs[0]:
        return None
    ratios = [run[name]["tok_s"] / run[other]["tok_s"] for run in runs]
    return {"ratio": statistics.median(ratios), "range": [min(ratios), max(ratios)]}


def verdict(ratio: dict[str, Any]) -> str:
    """wins / loses when the median advantage exceeds half the rounds' spread; else tie."""
    median, (low, high) = ratio["ratio"], ratio["range"]
    if abs(median - 1.0) <= (high - low) / 2:
        return "tie"
    return "wins" if median > 1.0 else "loses"


def print_table(results: dict[str, Any]) -> None:
    def fmt(p: dict | None) -> str:
        return "" if p is None else f"{p['ratio']:.3f} [{p['range'][0]:.2f}-{p['range'][1]:.2f}]"

    for name, r in results["artifacts"].items():
        print(f"\n{name}: γ {r['gamma']} (manifest batch limit {r['manifest_max_batch_size']}, "
              f"lifted), {r['num_rounds']} rounds, load "
              f"{min(r['loadavg']):.1f}-{max(r['loadavg']):.1f}, greedy, {results['gen']} "
              f"tokens, {results['threads']} thread(s)")
        print("| batch | config | tok/s (median) | range | vs off | vs full | tokens/step | "
              "acceptance | spec steps | outputs differ |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for batch, t in r["summary"].items():
            for config, row in t["configs"].items():
                print(f"| {batch} | {config} | {row['tok_s']:.1f} | {row['tok_s_range'][0]:.1f}-"
                      f"{row['tok_s_range'][1]:.1f} | {fmt(row['vs_off'])} | "
                      f"{fmt(row['vs_full'])} | {row['tokens_per_step']:.3f} | "
                      f"{row['acceptance']:.2f} | {row['spec_step_share']:.0%} | "
                      f"{row['outputs_differ']} |")
        print("\n| batch | controller | with / without (median [range]) | verdict |")
        print("|---|---|---|---|")
        for batch, t in r["summary"].items():
            for controller, w in t["controllers"].items():
                print(f"| {batch} | {controller} ({w['with']} / {w['without']}) | {fmt(w)} | "
                      f"{w['verdict']} |")


if __name__ == "__main__":
    main()
