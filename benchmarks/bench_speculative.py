"""Speculative decoding on SmolLM2: speed with and without each draft, and why.

    python benchmarks/bench_speculative.py --artifacts ngram=out/spec-ngram,tiny=out/spec-tiny

Each artifact runs in its own worker process (ONNX Runtime pinned to --threads), which
loads it once and runs it with speculation on (the manifest's γ and batch-size limit) and
off (its speculator detached; `--build-first spec|plain` loads two engines instead),
interleaving the two on the same prompts:

- batch 1, greedy, up to `--gen` new tokens (stopping at EOS: past it a chat model
  rambles, which is not what users run), per category of each prompt mix: decode tok/s
  (after the first token), speedup, acceptance rate α, accepted drafts per speculative
  step, output tokens per target step, and the speedup the formula predicts from α, γ
  and the costs measured below. Two mixes: `v2` (`prompts/spec_mix_v2.jsonl`, fixed
  before any draft tuning: chat, raw completion, code, structured text, copying) is the
  one to judge drafts by; `old` (chat, code, repetition, below) is kept for comparison
  with earlier figures. A draft is only as good as its `v2` "all" row;
- batches of the v2 mix, `--batches`: aggregate tok/s on vs off (the target is >= 0.95x);
- step costs, timed directly on the executors at batch 1 and a 128-token context: the
  target's verification step of q = 1..γ+1 tokens against q single-token steps, and the
  draft's single-token step against the target's.

Prints a table and writes JSON to benchmarks/results/bench_speculative.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info, run_json_worker, thread_env, write_json  # noqa: E402

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. All that glitters is not gold. Actions speak louder than words. The early "
    "bird catches the worm. Where there is a will, there is a way."
)
CODE = '''def average(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def largest(values):
    best = values[0]
    for value in values:
        if value > best:
            best = value
    return best
'''
Prompt = str | list[dict[str, str]]  # one user message, or a whole conversation
MIX_V2 = Path(__file__).resolve().parent / "prompts" / "spec_mix_v2.jsonl"
PROMPTS: dict[str, list[Prompt]] = {  # the "old" mix
    "chat": [
        "What are three tips for staying healthy?",
        "Explain what a black hole is in simple terms.",
        "Write a short story about a robot who learns to paint.",
    ],
    "code": [
        "Write a Python function that checks whether a number is prime.",
        "Write a Python class for a bank account with deposit and withdraw methods.",
        f"Add type hints and docstrings to this Python code:\n\n{CODE}",
    ],
    "repetition": [
        f"Repeat the following text exactly, twice:\n\n{PASSAGE}",
        f"Rename the function `average` to `mean` in this code and print the whole file:\n\n"
        f"{CODE}",
        "Copy this list, one item per line, keeping the numbers:\n1. apples\n2. bananas\n"
        "3. cherries\n4. dates\n5. elderberries\n6. figs\n7. grapes\n8. honeydew",
        f"Quote the second and third sentences of this text word for word:\n\n{PASSAGE}",
        [  # revising an earlier answer: the chat history holds what gets repeated
            {"role": "user", "content": "What are three tips for staying healthy?"},
            {"role": "assistant", "content": "1. Eat a balanced diet with plenty of fruits and "
             "vegetables.\n2. Exercise for at least 30 minutes a day.\n3. Get seven to eight "
             "hours of sleep each night."},
            {"role": "user", "content": "Repeat your answer, but add a one-sentence "
             "explanation after each tip."},
        ],
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", required=True,
                        help="Comma-separated NAME=PATH of artifacts compiled with a draft.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3,
                        help="Runs of each prompt (batch) on and off, interleaved; median.")
    parser.add_argument("--sweep-rounds", type=int, default=None,
                        help="--rounds for the batch sweep (default: --rounds). Where a "
                        "batch size speculates little, on and off do the same work and "
                        "their ratio is this machine's run-to-run noise (single runs of "
                        "batch 16 swing +-12 %% here); more rounds narrow its median.")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--mixes", default="v2,old", help="Prompt mixes to run: v2, old.")
    parser.add_argument("--sweep-gen", type=int, default=48,
                        help="New tokens per prompt in the batch sweep (EOS ignored).")
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--build-first", choices=("one", "spec", "plain"), default="one",
                        help="one: a single engine, its speculator detached for the plain "
                        "runs (same weights and pool: no build-order bias); spec/plain: two "
                        "engines, that one built first (it tends to run slower).")
    parser.add_argument("--sweep-only", action="store_true",
                        help="Only the batch sweep and step costs (no per-category batch 1).")
    parser.add_argument("--trees", default="",
                        help="Comma-separated NAMEs of --artifacts whose suffix n-gram drafts "
                        "run as draft trees (LLM(draft_tree=True); the same PATH may be "
                        "given twice under two names).")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_speculative.json")
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sweep_rounds = args.sweep_rounds or args.rounds
    if args.worker:
        print(json.dumps(run_worker(Path(args.worker[1]), args,
                                    args.worker[0] in args.trees.split(","))))
        return
    results = {"machine": machine_info(), "threads": args.threads, "gen": args.gen,
               "rounds": args.rounds, "sweep_rounds": args.sweep_rounds,
               "artifacts": {}}
    for item in args.artifacts.split(","):
        name, path = item.split("=", 1)
        print(f"[{name}] {path} ...", flush=True)
        worker_args = [__file__, "--artifacts", args.artifacts, "--threads", str(args.threads),
                       "--gen", str(args.gen), "--rounds", str(args.rounds),
                       "--sweep-rounds", str(args.sweep_rounds),
                       "--batches", args.batches, "--mixes", args.mixes,
                       "--sweep-gen", str(args.sweep_gen),
                       "--max-context", str(args.max_context),
                       *(["--sweep-only"] if args.sweep_only else []),
                       "--build-first", args.build_first, "--trees", args.trees,
                       "--worker", name, path]
        results["artifacts"][name] = run_json_worker(worker_args, thread_env(args.threads))
    results["loadavg_at_end"] = list(__import__("os").getloadavg())
    print_tables(results)
    write_json(args.out, results)
    print(f"wrote {args.out}")


# ------------------------------------------------------------------------- the worker
class SpeculationOff:
    """A speculating LLM run with its speculator detached: the plain engine that
    `LLM(path, speculative=False)` builds is the same engine without one, so this is the
    plain mode on the very same executor, weights and pool."""

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.engine

    def generate(self, prompts, params):
        speculator, self.engine.speculator = self.engine.speculator, None
        try:
            return self.llm.generate(prompts, params)
        finally:
            self.engine.speculator = speculator


def run_worker(path: Path, args: argparse.Namespace, trees: bool = False) -> dict[str, Any]:
    from llmopt.runtime import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",") if b]
    # No prefix caching: the same prompts run in several phases, and step_costs writes
    # garbage into pool blocks; decode speed is what is measured.
    common = {"num_threads": args.threads, "max_num_seqs": max(batches, default=1),
              "max_context": args.max_context, "enable_prefix_caching": False}
    # Measured (2026-11-24): of three identical engines built in one process, the first
    # built ran batch-2 decoding 12-16 % slower than the third, whichever had
    # speculation on; so by default one engine runs both modes.
    if args.build_first == "one":
        spec_llm = LLM(path, draft_tree=trees, **common)
        plain_llm = SpeculationOff(spec_llm)
    elif args.build_first == "spec":
        spec_llm = LLM(path, draft_tree=trees, **common)
        plain_llm = LLM(path, speculative=False, **common)
    else:
        plain_llm = LLM(path, speculative=False, **common)
        spec_llm = LLM(path, draft_tree=trees, **common)
    spec = spec_llm.manifest.speculative
    params = SamplingParams(temperature=0.0, max_tokens=args.gen)
    steady = SamplingParams(temperature=0.0, max_tokens=args.sweep_gen, ignore_eos=True)
    mixes = {name: encode_mix(spec_llm.tokenizer, name) for name in args.mixes.split(",")}
    first = next(iter(next(iter(mixes.values())).values()))[0]
    for llm in {id(e): e for e in (spec_llm, plain_llm)}.values():  # warm-up (once each)
        llm.generate([first], SamplingParams(temperature=0.0, max_tokens=8))

    costs = step_costs(spec_llm, spec.gamma)
    results = {} if args.sweep_only else {
        name: batch1_mix(spec_llm, plain_llm, encoded, params, args.rounds, spec.gamma, costs)
        for name, encoded in mixes.items()}
    sweep_mix = [p for prompts in next(iter(mixes.values())).values() for p in prompts]
    by_batch = {batch: batch_sweep(spec_llm, plain_llm, sweep_mix, batch, steady,
                                   args.sweep_rounds)
                for batch in batches}
    return {"path": str(path), "gamma": spec.gamma, "max_batch_size": spec.max_batch_size,
            "draft_tree": trees,
            "kinds": [k for k in ("ngram", "model") if getattr(spec, k) is not None],
            "draft_kind": spec.model.kind if spec.model else None,
            "ngram": spec.ngram.model_dump() if spec.ngram else None,
            "compile_time_acceptance": spec.acceptance, "compile_time_cost_ratio":
            spec.cost_ratio, "mixes": results, "step_costs": costs, "by_batch": by_batch,
            "loadavg": list(__import__("os").getloadavg())}


def encode_mix(tokenizer, name: str) -> dict[str, list[list[int]]]:
    """Token ids of a mix's prompts by category: `old` (PROMPTS, all chat) or `v2` (the
    fixed file; chat prompts through the chat template, text prompts as raw text)."""
    if name == "old":
        return {cat: [tokenizer.encode_chat(as_messages(p)) for p in prompts]
                for cat, prompts in PROMPTS.items()}
    if name != "v2":
        raise ValueError(f"unknown prompt mix {name!r} (v2, old)")
    encoded: dict[str, list[list[int]]] = {}
    for line in MIX_V2.read_text().splitlines():
        row = json.loads(line)
        if "prompt" not in row:
            continue  # the header comment
        ids = (tokenizer.encode_chat(as_messages(row["prompt"])) if row["format"] == "chat"
               else tokenizer.encode(row["prompt"]))
        encoded.setdefault(row["category"], []).append(ids)
    return encoded


def batch1_mix(spec_llm, plain_llm, encoded: dict[str, list[list[int]]], params,
               rounds: int, gamma: int, costs: dict[str, Any]) -> dict[str, Any]:
    """Per-category and whole-mix summaries at batch 1; prompts whose greedy outputs
    differ on and off are counted (they must not exist)."""
    per_category, runs_on, runs_off, differing = {}, [], [], 0
    for category, prompts in encoded.items():
        on, off = [], []
        for prompt in prompts:
            pair = timed_pair(spec_llm, plain_llm, [prompt], params, rounds)
            differing += pair["on"]["token_ids"] != pair["off"]["token_ids"]
            on.append(pair["on"])
            off.append(pair["off"])
        per_category[category] = summarize(on, off)
        runs_on += per_category[category].pop("runs_on")
        runs_off += per_category[category].pop("runs_off")
        add_predictions(per_category[category], gamma, costs)
    overall = summarize(runs_on, runs_off)
    overall.pop("runs_on"), overall.pop("runs_off")
    add_predictions(overall, gamma, costs)
    return {"per_category": per_category, "overall": overall,
            "greedy_outputs_differ": differing}


def batch_sweep(spec_llm, plain_llm, mix: list[list[int]], batch: int, params,
                rounds: int) -> dict[str, Any]:
    """Every prompt of the mix at least once, in batches of `batch` (cycling the mix)."""
    count = -(-len(mix) // batch) * batch
    cycled = (mix * (count // len(mix) + 1))[:count]
    with modelled_costs(spec_llm, plain_llm) as modelled:
        pairs = [timed_pair(spec_llm, plain_llm, cycled[i : i + batch], params, rounds)
                 for i in range(0, count, batch)]
    speed = {mode: sum(p[mode]["decode_tokens"] for p in pairs)
             / sum(p[mode]["decode_tokens"] / p[mode]["tok_s"] for p in pairs)
             for mode in ("on", "off")}
    return {"plain_tok_s": speed["off"], "spec_tok_s": speed["on"],
            "speedup": speed["on"] / speed["off"], "prompts": count,
            "speculated": any(p["on"]["spec_steps"] for p in pairs),
            # Load-robust: each sequence's output tokens per target step it took part in,
            # and the share of those steps that verified drafts.
            "modelled_speedup": modelled["off"] / modelled["on"] if modelled["on"] else None,
            "tokens_per_step": sum(p["on"]["output_tokens"] for p in pairs)
            / sum(p["on"]["decode_steps"] for p in pairs),
            "spec_step_share": sum(p["on"]["spec_steps"] for p in pairs)
            / sum(p["on"]["decode_steps"] for p in pairs)}


@contextlib.contextmanager
def modelled_costs(spec_llm, plain_llm):
    """Sum, per mode, what every executed step costs by the speculation policy's step
    model (the compiler's batch × width table, calls padded as the executors pad them).
    Both modes emit the same tokens (EOS ignored), so off/on of these sums is a speedup
    that no load swing touches; it trusts the model's costs, not its acceptance guesses."""
    policy = spec_llm.engine.speculator and spec_llm.engine.speculator.policy
    totals = {"on": 0.0, "off": 0.0}
    if policy is None:
        yield totals
        return
    originals = {}
    for llm in (spec_llm, plain_llm):
        engine, executor = llm.engine, llm.engine.executor
        if id(executor) in originals:  # one engine runs both modes
            continue
        originals[id(executor)] = executor, executor.execute

        def execute(batch, engine=engine, run=executor.execute):
            mode = "off" if engine.speculator is None else "on"
            totals[mode] += policy.step_model.step_cost(batch.query_lens)
            return run(batch)
        executor.execute = execute
    try:
        yield totals
    finally:
        for executor, run in originals.values():
            executor.execute = run


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def timed_pair(spec_llm, plain_llm, prompts: list[list[int]], params,
               rounds: int) -> dict[str, dict[str, Any]]:
    """Each mode `rounds` times, interleaved (so load changes hit both alike) and in
    alternating order (off first, then on first: whichever runs second may find the
    other's weights in cache or its cores warm); the run of median speed of each."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    llms = {"off": plain_llm, "on": spec_llm}
    for round_ in range(rounds):
        for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            runs[mode].append(timed_generate(llms[mode], prompts, params))
    return {mode: sorted(r, key=lambda run: run["tok_s"])[len(r) // 2]
            for mode, r in runs.items()}


def timed_generate(llm, prompts: list[list[int]], params) -> dict[str, Any]:
    """Aggregate decode tok/s of one batch (tokens after each first token / decode time)."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    decode_tokens = sum(len(o.token_ids) - 1 for o in outputs)
    decode_time = max(o.metrics.finished_time for o in outputs) - min(
        o.metrics.first_token_time for o in outputs)
    spec = [o.metrics.speculation for o in outputs]
    return {
        "tok_s": decode_tokens / decode_time, "wall_s": wall, "decode_tokens": decode_tokens,
        "token_ids": [o.token_ids for o in outputs],
        "decode_steps": sum(s.num_decode_steps for s in spec),
        "spec_steps": sum(s.num_spec_steps for s in spec),
        "draft_tokens": sum(s.num_draft_tokens for s in spec),
        "accepted_tokens": sum(s.num_accepted_tokens for s in spec),
        "output_tokens": sum(len(o.token_ids) for o in outputs),
    }


def summarize(on: list[dict], off: list[dict]) -> dict[str, Any]:
    def total(runs: list[dict], key: str) -> float:
        return sum(r[key] for r in runs)

    # Speed over a category: total decode tokens / total decode time, for each mode.
    def speed(runs: list[dict]) -> float:
        return total(runs, "output_tokens") / sum(r["output_tokens"] / r["tok_s"] for r in runs)

    drafts = total(on, "draft_tokens")
    return {
        "plain_tok_s": speed(off), "spec_tok_s": speed(on), "speedup": speed(on) / speed(off),
        "acceptance_rate": total(on, "accepted_tokens") / drafts if drafts else 0.0,
        "mean_accepted_length": (total(on, "accepted_tokens") / total(on, "spec_steps")
                                 if total(on, "spec_steps") else 0.0),
        "tokens_per_step": total(on, "output_tokens") / total(on, "decode_steps"),
        "decode_steps": total(on, "decode_steps"), "spec_steps": total(on, "spec_steps"),
        "draft_tokens": drafts,
        "runs_on": on, "runs_off": off,
    }


def step_costs(llm, gamma: int, context: int = 128, repeats: int = 15) -> dict[str, Any]:
    """Median ms of the target's step with q = 1..γ+1 query tokens and of the draft's
    one-token step, batch 1, on a `context`-token sequence; and the ratios that decide
    whether speculation can pay."""
    from llmopt.runtime.executors.step_batch import SequenceStep, StepBatch, make_step_batch

    engine = llm.engine
    block_size = engine.config.block_size
    blocks = list(range(1, (context + gamma + 1) // block_size + 2))

    def batch(q: int) -> StepBatch:
        sequence = SequenceStep([100 + i for i in range(q)], context, blocks, range(q))
        return make_step_batch([sequence], block_size)

    def median_ms(executor, q: int) -> float:
        executor.execute(batch(q))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            executor.execute(batch(q))
            times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)

    target = {q: median_ms(engine.executor, q) for q in range(1, gamma + 2)}
    drafter = engine.speculator.drafter
    model = getattr(drafter, "second", drafter)
    draft_ms = median_ms(model.executor, 1) if hasattr(model, "executor") else 0.0
    return {
        "target_ms": target, "draft_ms": draft_ms,
        "draft_cost_ratio": draft_ms / target[1],
        "verify_ratio": {q: target[q] / target[1] for q in target},  # vs one 1-token step
        "verify_vs_sequential": {q: target[q] / (q * target[1]) for q in target},
    }


def predicted_speedup(alpha: float, gamma: int, costs: dict[str, Any]) -> float:
    """Leviathan et al.'s expected speedup with i.i.d. acceptance α: tokens per step
    (1 - α^(γ+1)) / (1 - α) over the step's cost γ·c + verify(γ+1), in target steps."""
    from llmopt.runtime.speculative.cost_model import expected_tokens, model_step_cost

    cost = model_step_cost(gamma, costs["draft_cost_ratio"], costs["verify_ratio"][gamma + 1])
    return expected_tokens(alpha, gamma) / cost


def add_predictions(summary: dict[str, Any], gamma: int, costs: dict[str, Any]) -> None:
    """Two predictions beside the measured speedup:

    - `predicted_speedup`: Leviathan et al.'s formula from the measured α, the manifest's
      γ and the step costs (i.i.d. acceptance, γ drafts every step);
    - `accounted_speedup`: the measured tokens per step over the cost of the steps that
      actually ran (plain ones cost 1, a speculative one the verification cost of its mean
      draft count): what the speedup would be with no host overhead. Measured below it
      is drafting, verification and bookkeeping in Python.
    """
    summary["predicted_speedup"] = predicted_speedup(summary["acceptance_rate"], gamma, costs)
    steps, spec_steps = summary["decode_steps"], summary["spec_steps"]
    ratio = costs["verify_ratio"]
    mean_q = 1 + summary["draft_tokens"] / spec_steps if spec_steps else 1.0
    verify = float(np.interp(mean_q, sorted(ratio), [ratio[q] for q in sorted(ratio)]))
    cost_per_step = (steps - spec_steps + spec_steps * verify) / steps
    summary["accounted_speedup"] = summary["tokens_per_step"] / cost_per_step


# ------------------------------------------------------------------------- the table
def print_tables(results: dict[str, Any]) -> None:
    print(f"\nbatch 1, greedy, {results['gen']} new tokens, {results['threads']} thread(s)")
    print("| draft | γ | mix | prompts | plain tok/s | spec tok/s | speedup | predicted "
          "(formula) | accounted | α | accepted/step | tokens/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results["artifacts"].items():
        for mix, m in r["mixes"].items():
            rows = {**m["per_category"], "all": m["overall"]}
            for category, s in rows.items():
                print(f"| {name} | {r['gamma']} | {mix} | {category} | "
                      f"{s['plain_tok_s']:.1f} | {s['spec_tok_s']:.1f} | "
                      f"**{s['speedup']:.2f}x** | {s['predicted_speedup']:.2f}x | "
                      f"{s['accounted_speedup']:.2f}x | {s['acceptance_rate']:.2f} | "
                      f"{s['mean_accepted_length']:.2f} | {s['tokens_per_step']:.2f} |")
            if m["greedy_outputs_differ"]:
                print(f"| {name} | | {mix} | GREEDY OUTPUTS DIFFER on "
                      f"{m['greedy_outputs_differ']} prompts | | | | | | | | |")
    print("\nbatch sweep (the first mix, aggregate decode tok/s; speculation off above the "
          "manifest's max_batch_size)")
    print("| draft | max_batch_size | batch | prompts | plain tok/s | spec tok/s | speedup | "
          "modelled | tokens/step | speculative steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results["artifacts"].items():
        for batch, b in r["by_batch"].items():
            print(f"| {name} | {r['max_batch_size']} | {batch} | {b['prompts']} | "
                  f"{b['plain_tok_s']:.1f} | "
                  f"{b['spec_tok_s']:.1f} | {b['speedup']:.2f}x | "
                  f"{b['modelled_speedup'] or 0:.2f}x | {b['tokens_per_step']:.2f} | "
                  f"{b['spec_step_share']:.0%} |")
    print("\nstep costs (batch 1, context 128): (q)-token step / 1-token step")
    for name, r in results["artifacts"].items():
        c = r["step_costs"]
        ratios = ", ".join(f"q={q}: {v:.2f}" for q, v in c["verify_ratio"].items())
        print(f"- {name}: target 1-token step {c['target_ms']['1']:.1f} ms, draft step "
              f"{c['draft_ms']:.2f} ms (ratio {c['draft_cost_ratio']:.3f}); {ratios} "
              f"(load {r['loadavg'][0]:.1f})")


if __name__ == "__main__":
    main()
