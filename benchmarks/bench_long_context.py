"""Streaming past the context (attention sinks + a window, `kv.streaming`) and H2O
(heavy hitters + a recent window, `kv.h2o`) against full attention on
SmolLM2-135M-Instruct (context 8192), int4 weights, float32 KV lanes, the native step.

1. Perplexity over long texts (the first `--tokens` tokens of each, fixed files on this
   machine): full attention, sinks + window (sinks 4) and H2O (recent half the budget,
   no sinks: the paper's rule) at each `--budgets`. Scored in chunks of `--chunk`
   tokens, so a token sees the sinks and between budget - chunk - block and budget - 4
   recent tokens (H2O: the recent half and the heavy hitters). Also the perplexity of
   the tokens past the smallest budget only (before it nothing is dropped and the runs
   are equal).
2. A retrieval probe: a pass code planted at the start, licence text after it, then the
   question; the log-probability of the code's tokens and whether greedy decoding
   says it, at several distances, full attention against both at the smallest budget.
3. What H2O costs per decode step beside sinks + window at the largest budget: greedy
   decoding past the budget (evictions included), H2O at each of `--drops` (its default
   drop, a sixteenth of the budget; 1: the paper's one entry a step), the runs
   interleaved `--cost-rounds` times; mean ms per step over the steps past the budget.
4. A `--gen`-token greedy generation in a lane of the largest budget (memory per
   sequence: its lane's KV bytes; decode tok/s around 2k, 8k, 16k and at the end),
   beside full attention decoding its last 256 tokens up to 8k in a lane of 8k.

    python benchmarks/bench_long_context.py --artifact /tmp/smollm2-int4-8k
    python benchmarks/bench_long_context.py --skip ppl,probe,gen --drops default,1 \
        --cost-rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_ROOT, RESULTS_DIR, compile_artifact, machine_info, write_json

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.kv.h2o import H2OConfig
from llmopt.runtime.kv.streaming import StreamingConfig

SINKS = 4
LICENCES = Path("/usr/share/common-licenses")
TEXTS = {  # name -> the files concatenated, in order
    "licences": [LICENCES / name for name in ("GPL-3", "GFDL-1.3", "Apache-2.0", "MPL-2.0",
                                               "LGPL-2.1")],
    "python-argparse": [Path("/usr/lib/python3.11/argparse.py")],
    "vim-usr_41": [Path("/usr/share/vim/vim90/doc/usr_41.txt")],
}
CODE = "48213"
FACT = f"Remember this: the secret pass code is {CODE}. "
QUESTION = "\n\nQuestion: what is the secret pass code? Answer: the secret pass code is"


def read_text(name: str) -> str:
    missing = [str(p) for p in TEXTS[name] if not p.is_file()]
    if missing:
        raise SystemExit(f"text {name}: missing {', '.join(missing)}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in TEXTS[name])


THREADS: int | None = None  # every engine's (--threads; None: the machine's cores)
KERNELS = "auto"  # the evicting engines' kernels (--kernels)


def streaming_llm(artifact: Path, budget: int, chunk: int) -> LLM:
    return LLM(artifact, max_num_seqs=1, max_context=budget, max_num_batched_tokens=chunk,
               streaming=StreamingConfig(sinks=SINKS, window=budget - SINKS),
               num_threads=THREADS, kernels=KERNELS)


def h2o_llm(artifact: Path, budget: int, chunk: int, sinks: int = 0,
            drop: int | None = None) -> LLM:
    return LLM(artifact, max_num_seqs=1, max_context=budget, max_num_batched_tokens=chunk,
               streaming=H2OConfig(budget=budget, sinks=sinks, drop=drop),
               num_threads=THREADS, kernels=KERNELS)


def evicting_llms(artifact: Path, budgets: list[int], chunk: int, kinds: set[str],
                  h2o_sinks: int) -> dict[str, LLM]:
    """Sinks + window and H2O at each budget, by label (those of `kinds`)."""
    llms = {}
    for b in budgets:
        if "sinks+window" in kinds:
            llms[f"sinks+window {b}"] = streaming_llm(artifact, b, chunk)
        if "h2o" in kinds:
            label = f"h2o {b}" if not h2o_sinks else f"h2o sinks {h2o_sinks} {b}"
            llms[label] = h2o_llm(artifact, b, chunk, h2o_sinks)
    return llms


def perplexities(artifact: Path, tokens: int, budgets: list[int], chunk: int,
                 kinds: set[str], h2o_sinks: int) -> list[dict[str, Any]]:
    full = LLM(artifact, max_num_seqs=1, max_context=tokens, max_num_batched_tokens=512)
    rows = []
    for name in TEXTS:
        text = read_text(name)
        ids = full.tokenizer.encode(text)
        if len(ids) < tokens:
            raise SystemExit(f"text {name} has {len(ids)} tokens, fewer than {tokens}")
        ids = ids[:tokens]
        row: dict[str, Any] = {"text": name, "tokens": tokens,
                               "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
        runs = {"full": full} if "full" in kinds else {}
        runs.update(evicting_llms(artifact, budgets, chunk, kinds, h2o_sinks))
        past = min(budgets)
        for label, llm in runs.items():
            started = time.perf_counter()
            logprobs = llm.score(ids)
            seconds = time.perf_counter() - started
            row[label] = {"ppl": float(np.exp(-logprobs.mean())),
                          f"ppl_past_{past}": float(np.exp(-logprobs[past - 1:].mean())),
                          "seconds": round(seconds, 1)}
            print(f"  {name:16s} {label:20s} ppl {row[label]['ppl']:8.3f} (past {past}: "
                  f"{row[label][f'ppl_past_{past}']:8.3f}) {seconds:6.1f} s", flush=True)
        rows.append(row)
    return rows


def retrieval(artifact: Path, distances: list[int], budget: int, chunk: int
              ) -> list[dict[str, Any]]:
    full = LLM(artifact, max_num_seqs=1, max_num_batched_tokens=512,
               max_context=max(distances) + 256)
    runs = {"full": full, f"sinks+window {budget}": streaming_llm(artifact, budget, chunk),
            f"h2o {budget}": h2o_llm(artifact, budget, chunk)}
    tok = full.tokenizer
    filler = tok.encode(read_text("licences"))
    answer = tok.encode(" " + CODE)
    rows = []
    for distance in distances:
        prompt = tok.encode(FACT) + filler[:distance] + tok.encode(QUESTION)
        row: dict[str, Any] = {"distance": distance, "prompt_tokens": len(prompt)}
        for label, llm in runs.items():
            logprobs = llm.score(prompt + answer)[-len(answer):]
            out = llm.generate(prompt, SamplingParams(max_tokens=len(answer) + 2,
                                                      temperature=0.0))[0]
            row[label] = {"answer_logprob": float(logprobs.sum()),
                          "greedy_says_it": CODE in out.text, "greedy": out.text}
            print(f"  distance {distance:5d} {label:20s} log p(code) "
                  f"{logprobs.sum():8.3f}  greedy {out.text!r}", flush=True)
        rows.append(row)
    return rows


def timed_generation(llm: LLM, prompt: list[int], gen: int, marks: list[int]
                     ) -> dict[str, Any]:
    """Greedy tokens one step at a time; decode tok/s over the 256 tokens before each
    mark (total tokens: prompt + generated), lane KV bytes and blocks held."""
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    engine.add_request(prompt, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    times: list[float] = []
    held = 0
    while engine.has_unfinished_requests():
        engine.step()
        times.append(time.perf_counter())
        for request in engine.scheduler.running:
            held = max(held, manager.blocks_held(request)["full"])
    pools = llm.engine.executor.pools
    lane_bytes = sum(a.nbytes for a in pools.values()) // pools.num_lanes
    decode = times[-gen:]  # one step per generated token after the prefill
    rates = {}
    for mark in marks:
        end = mark - len(prompt)
        if 256 <= end <= len(decode):  # 255 step intervals ending at the mark
            rates[str(mark)] = round(255 / (decode[end - 1] - decode[end - 256]), 1)
    return {"prompt": len(prompt), "generated": gen, "lane_kv_mib": lane_bytes / 2**20,
            "max_blocks_held": held, "decode_tok_s_at": rates,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def step_times(llm: LLM, prompt: list[int], gen: int) -> list[float]:
    """Seconds of each greedy decode step after the prefill."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times[-gen + 1:]


def decode_cost(artifact: Path, budget: int, rounds: int, drops: list[int | None]
                ) -> dict[str, Any]:
    """Mean ms per decode step past the budget, sinks + window against H2O at each drop
    (None: its default), interleaved."""
    text = LLM(artifact, max_num_seqs=1, max_context=budget).tokenizer.encode(
        read_text("licences"))
    prompt, gen = text[:budget // 2], budget
    llms = {"sinks+window": streaming_llm(artifact, budget, 512)}
    for drop in drops:
        llms["h2o" if drop is None else f"h2o drop {drop}"] = h2o_llm(artifact, budget, 512,
                                                                      drop=drop)
    past: dict[str, list[float]] = {label: [] for label in llms}
    for i in range(rounds):
        for label in (list(llms) if i % 2 == 0 else list(reversed(llms))):
            times = step_times(llms[label], prompt, gen)
            past[label] += times[budget - len(prompt):]  # the steps past the budget
    result = {label: {"steps": len(t), "ms_per_step": round(1e3 * float(np.mean(t)), 3),
                      "median_ms": round(1e3 * float(np.median(t)), 3),
                      "max_ms": round(1e3 * float(np.max(t)), 1)} for label, t in past.items()}
    for label in list(llms)[1:]:
        result[f"{label} over streaming"] = round(result[label]["ms_per_step"]
                                                  / result["sinks+window"]["ms_per_step"], 3)
    print(f"  decode cost at {budget}: {result}", flush=True)
    return {"budget": budget, "rounds": rounds, **result}


def generation(artifact: Path, gen: int, budget: int, skip: set[str]) -> dict[str, Any]:
    text = LLM(artifact, max_num_seqs=1, max_context=budget).tokenizer.encode(
        read_text("licences") + read_text("vim-usr_41"))
    prompt = text[:1024]
    result = {}
    if "gen-stream" not in skip:
        streamed = streaming_llm(artifact, budget, 512)
        marks = [2048, 8192, 16384, len(prompt) + gen]
        result["streaming"] = timed_generation(streamed, prompt, gen, marks)
        print(f"  streaming {budget}: {result['streaming']}", flush=True)
        del streamed
    # full attention at the end of its context: a prefill to 8k - 256, then 256 tokens
    full = LLM(artifact, max_num_seqs=1, max_context=8192, speculative=False)
    result["full"] = timed_generation(full, text[:8192 - 257], 256, [8191])
    print(f"  full 8k: {result['full']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=Path("/tmp/smollm2-int4-8k"),
                        help="compiled here from recipes/smollm2-135m-int4.yaml if missing")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budgets", default="2048,1024")
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--distances", default="512,1536,4096,7168")
    parser.add_argument("--gen", type=int, default=20000)
    parser.add_argument("--cost-rounds", type=int, default=2)
    parser.add_argument("--drops", default="default",
                        help="H2O drops the cost step times: comma list of 'default' (a "
                             "sixteenth of the budget) and entry counts (1: the paper's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="every engine's threads (default: the machine's cores)")
    parser.add_argument("--kernels", choices=("auto", "native", "onnxruntime"), default="auto",
                        help="the evicting engines' kernels; onnxruntime compiles the artifact "
                             "with runtime.h2o, whose graph returns the attention sums")
    parser.add_argument("--ppl-runs", default="full,sinks+window,h2o",
                        help="which perplexity runs: comma list of full,sinks+window,h2o")
    parser.add_argument("--h2o-sinks", type=int, default=0,
                        help="positions H2O always keeps first (the paper: none)")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to skip: ppl,probe,cost,gen (or gen-stream)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_long_context.json")
    args = parser.parse_args()
    global THREADS, KERNELS
    THREADS, KERNELS = args.threads, args.kernels
    budgets = [int(b) for b in args.budgets.split(",")]
    h2o_graph = [f"runtime.h2o.budget={max(budgets)}"] if KERNELS == "onnxruntime" else []
    compile_artifact(args.artifact, REPO_ROOT / "recipes" / "smollm2-135m-int4.yaml",
                     ["runtime.max_context=8192", "runtime.max_num_seqs=1", *h2o_graph])
    skip = set(args.skip.split(",")) - {""}
    payload: dict[str, Any] = {"machine": machine_info(), "artifact": str(args.artifact),
                               "sinks": SINKS, "chunk": args.chunk}
    if "ppl" not in skip:
        print("perplexity:", flush=True)
        payload["perplexity"] = perplexities(args.artifact, args.tokens, budgets, args.chunk,
                                             set(args.ppl_runs.split(",")), args.h2o_sinks)
    if "probe" not in skip:
        print("retrieval probe:", flush=True)
        payload["retrieval"] = retrieval(args.artifact, [int(d) for d in
                                                         args.distances.split(",")],
                                         min(budgets), args.chunk)
    if "cost" not in skip:
        print("decode cost:", flush=True)
        drops = [None if d == "default" else int(d) for d in args.drops.split(",")]
        payload["decode_cost"] = decode_cost(args.artifact, max(budgets), args.cost_rounds,
                                             drops)
    if "gen" not in skip:
        print("generation:", flush=True)
        payload["generation"] = generation(args.artifact, args.gen, max(budgets), skip)
    write_json(args.out, payload)
    print_tables(payload, budgets)
    print(f"wrote {args.out}")


def print_tables(payload: dict[str, Any], budgets: list[int]) -> None:
    labels = [label for label in payload["perplexity"][0] if isinstance(
        payload["perplexity"][0][label], dict)] if "perplexity" in payload else []
    past = min(budgets)
    if "perplexity" in payload:
        print(f"\n| text | {' | '.join(labels)} |")
        print("|---|" + "---|" * len(labels))
        for row in payload["perplexity"]:
            cells = [f"{row[label]['ppl']:.3f} ({row[label][f'ppl_past_{past}']:.3f})"
                     for label in labels]
            print(f"| {row['text']} | {' | '.join(cells)} |")
    if "retrieval" in payload:
        print("\n| distance | full | sinks+window | h2o | (log p of the code / greedy says it)")
        print("|---|---|---|---|")
        for row in payload["retrieval"]:
            cells = [f"{row[label]['answer_logprob']:.2f} / {row[label]['greedy_says_it']}"
                     for label in row if label not in ("distance", "prompt_tokens")]
            print(f"| {row['distance']} | {' | '.join(cells)} |")
    if "generation" in payload:
        for label, run in payload["generation"].items():
            print(f"\n{label}: {run['prompt']} + {run['generated']} tokens, lane KV "
                  f"{run['lane_kv_mib']:.1f} MiB, blocks held {run['max_blocks_held']}, "
                  f"decode tok/s {run['decode_tok_s_at']}, peak RSS {run['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
