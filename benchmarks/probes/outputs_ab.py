"""Same outputs from two installs: run one artifact through whichever llmopt this Python
imports and record every token and logprob, then compare two such records exactly.

Meant for a change that must not change behaviour (a restructure, a new build): record
with the old install's Python and with the new one's, then `compare`. Only the public API
(`LLM`, `SamplingParams`) is used, so any two versions can be compared.

    OLD/bin/python benchmarks/probes/outputs_ab.py record ART old.json
    NEW/bin/python benchmarks/probes/outputs_ab.py record ART new.json
    python benchmarks/probes/outputs_ab.py compare old.json new.json

A record holds, for each kernels choice the artifact runs, greedy outputs one prompt at a
time (batch 1) and all together (batch 8), and seeded sampled outputs all together: token
ids and each token's logprob as float32 bits (so "same" means bit for bit).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "List three uses of copper, one per line:",
    "Why is the sky blue? Explain in two sentences.",
    "Once upon a time, in a small village by the river,",
    "Translate 'good morning' into Spanish, French and German.",
    "The three primary colours are red, blue and",
]
MAX_TOKENS = 48


def bits(value: float) -> str:
    """A logprob's float32 bit pattern, so equal means bit for bit."""
    return struct.pack("<f", value).hex()


def outputs(llm, params) -> list[dict]:
    return [{"tokens": list(out.token_ids),
             "logprobs": [bits(lp.logprob) for lp in out.logprobs or []]}
            for out in llm.generate(PROMPTS, params)]


def record(artifact: Path, kernels: list[str]) -> dict:
    from llmopt.runtime import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=7 + i,
                              logprobs=0) for i in range(len(PROMPTS))]
    result = {}
    for kernel in kernels:
        llm = LLM(artifact, kernels=kernel, num_threads=1)  # one thread: the same sums
        result[kernel] = {
            "in_use": llm.kernels_in_use(),
            "greedy_b1": [outputs_one(llm, prompt, greedy) for prompt in PROMPTS],
            "greedy_b8": outputs(llm, greedy),
            "sampled_b8": [{"tokens": list(out.token_ids),
                            "logprobs": [bits(lp.logprob) for lp in out.logprobs or []]}
                           for out in llm.generate(PROMPTS, sampled)],
        }
    return result


def outputs_one(llm, prompt: str, params) -> dict:
    [out] = llm.generate([prompt], params)
    return {"tokens": list(out.token_ids),
            "logprobs": [bits(lp.logprob) for lp in out.logprobs or []]}


def compare(old: dict, new: dict) -> list[str]:
    """Every difference between two records, as one line each (none: the same)."""
    lines = []
    for kernel in sorted(set(old) | set(new)):
        if kernel not in old or kernel not in new:
            lines.append(f"{kernel}: only in one record")
            continue
        for run in ("greedy_b1", "greedy_b8", "sampled_b8"):
            for i, (a, b) in enumerate(zip(old[kernel][run], new[kernel][run], strict=True)):
                for key in ("tokens", "logprobs"):
                    if a[key] != b[key]:
                        lines.append(f"{kernel} {run} prompt {i}: {key} differ")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("artifact", type=Path)
    rec.add_argument("out", type=Path)
    rec.add_argument("--kernels", default="onnxruntime,auto",
                     help="comma-separated kernels choices to run")
    cmp = sub.add_parser("compare")
    cmp.add_argument("old", type=Path)
    cmp.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        result = record(args.artifact, args.kernels.split(","))
        args.out.write_text(json.dumps(result))
        print(f"{args.artifact}: " + ", ".join(f"{k}: {v['in_use']}" for k, v in result.items()))
        return
    differences = compare(json.loads(args.old.read_text()), json.loads(args.new.read_text()))
    print("\n".join(differences) or "same: every token and logprob, bit for bit")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
