"""Structured output on a real model: does every answer parse and validate, and what do the
constraints cost?

Acceptance: one request per schema of `_json_schemas.schemas(seed, count)` (the seeded
generator, fixed before any tuning), each asking the model (chat template, greedy) to fill
in the schema given in the prompt, constrained to it by `response_format`-style JSON-schema
decoding; all run together through the engine (continuous batching). Reported: how many
finished, parsed as JSON and validated against their schema (`jsonschema`).

Cost: the first `--speed-requests` of those requests again at batch 1 (one at a time) and at
batch 8, constrained and unconstrained, the unconstrained ones generating exactly as many
tokens as their constrained twin at batch 1 (ignore_eos, max_tokens = that count): output
tok/s of each, and the ratio. `--speed-only` runs this part alone (its own JSON).

    python benchmarks/structured_output.py --artifact out/q4_1 [--count 100] [--threads 2]
    python benchmarks/structured_output.py --artifact out/q4_1 --speed-only --speed-requests 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from _json_schemas import schemas  # noqa: E402

from llmopt.runtime import LLM, SamplingParams  # noqa: E402
from llmopt.runtime.output import RequestOutput  # noqa: E402
from llmopt.runtime.structured import StructuredOutputsParams  # noqa: E402

SYSTEM = "You answer with a JSON object that matches this JSON schema:\n{schema}"
USER = "Fill in the object with realistic example values."


def prompt_ids(llm: LLM, schema: dict[str, Any]) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM.format(schema=json.dumps(schema))},
                {"role": "user", "content": USER}]
    return llm.tokenizer.encode_chat(messages)


def constrained(schema: dict[str, Any], max_tokens: int, penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=penalty,
                          structured_outputs=StructuredOutputsParams(json=schema))


def verdict(output: RequestOutput, schema: dict[str, Any]) -> str:
    """"valid", or what went wrong."""
    if output.finish_reason != "stop":
        return f"finish_reason {output.finish_reason}"
    try:
        jsonschema.validate(json.loads(output.text), schema)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return "valid"


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
          batch: int) -> tuple[float, list[RequestOutput]]:
    """(seconds, outputs) of running the requests `batch` at a time."""
    start, outputs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i : i + batch], params[i : i + batch])
    return time.perf_counter() - start, outputs


def speed(llm: LLM, prompts: list[list[int]], cases: list[dict[str, Any]], max_tokens: int,
          penalty: float) -> list[dict[str, Any]]:
    """tok/s with and without constraints at batch 1 and 8, the same token counts."""
    rows, plain = [], []
    with_grammar = [constrained(s, max_tokens, penalty) for s in cases]
    for batch in (1, 8):
        seconds_c, outputs = timed(llm, prompts, with_grammar, batch)
        # the unconstrained twins generate exactly the batch-1 constrained token counts
        plain = plain or [SamplingParams(max_tokens=len(o.token_ids), temperature=0.0,
                                         ignore_eos=True, repetition_penalty=penalty)
                          for o in outputs]
        seconds_p, plain_outputs = timed(llm, prompts, plain, batch)
        tokens_c = sum(len(o.token_ids) for o in outputs)
        tokens_p = sum(len(o.token_ids) for o in plain_outputs)
        # batching must not change constrained greedy outputs: then the counts match
        rows.append({"batch": batch, "tokens": tokens_c, "unconstrained_tokens": tokens_p,
                     "constrained_tok_s": round(tokens_c / seconds_c, 1),
                     "unconstrained_tok_s": round(tokens_p / seconds_p, 1),
                     "ratio": round((tokens_c / seconds_c) / (tokens_p / seconds_p), 3)})
    return rows


def validity(llm: LLM, args: argparse.Namespace, cases: list[dict[str, Any]],
             prompts: list[list[int]]) -> dict[str, Any]:
    """Every schema's request at once: how many parse and validate."""
    start = time.perf_counter()
    penalty = args.repetition_penalty
    outputs = llm.generate(prompts, [constrained(s, args.max_tokens, penalty) for s in cases])
    seconds = time.perf_counter() - start
    verdicts = [verdict(o, s) for o, s in zip(outputs, cases, strict=True)]
    valid = verdicts.count("valid")
    tokens = sum(len(o.token_ids) for o in outputs)
    finished = sum(o.finish_reason == "stop" for o in outputs)
    print(f"{args.count} schemas (seed {args.seed}, greedy, repetition penalty {penalty}): "
          f"{valid} parsed and validated ({100 * valid / args.count:.0f} %); {finished} "
          f"finished, {args.count - finished} hit max_tokens={args.max_tokens}; {tokens} tokens "
          f"in {seconds:.1f} s")
    for i, v in enumerate(verdicts):
        if v != "valid":
            print(f"  schema {i}: {v}: {outputs[i].text[:120]!r}")
    return {"valid": valid, "finished": finished, "count": args.count, "verdicts": verdicts,
            "seconds": seconds, "tokens": tokens, "texts": [o.text for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--speed-requests", type=int, default=16)
    parser.add_argument("--speed-only", action="store_true",
                        help="skip the validity run; JSON structured_output_speed.json")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="HF's, over prompt and output (1: off)")
    args = parser.parse_args()
    if args.speed_only and not args.speed_requests:
        parser.error("--speed-only needs --speed-requests > 0")
    # no prefix cache: the speed part reruns the same prompts, and every run should prefill
    llm = LLM(args.artifact, num_threads=args.threads, max_num_seqs=16,
              enable_prefix_caching=False)
    cases = schemas(args.seed, args.count)
    prompts = [prompt_ids(llm, s) for s in cases]
    penalty = args.repetition_penalty
    result = {"machine": machine_info(("llguidance", "jsonschema")),
              "args": vars(args) | {"artifact": str(args.artifact)}}
    name = "speed" if args.speed_only else f"rp{penalty}"
    out = RESULTS_DIR / f"structured_output_{name}.json"
    if not args.speed_only:
        result |= validity(llm, args, cases, prompts)
        write_json(out, result)
    n = args.speed_requests
    if not n:
        return
    rows = speed(llm, prompts[:n], cases[:n], args.max_tokens, penalty)
    print(f"\nthroughput, {n} requests ({rows[0]['tokens']} tokens), "
          f"{llm.execution_summary()}, load {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'constrained tok/s':>18} {'unconstrained tok/s':>20} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:5d} {r['constrained_tok_s']:18.1f} {r['unconstrained_tok_s']:20.1f} "
              f"{r['ratio']:6.3f}")
    write_json(out, result | {"speed": rows, "loadavg_at_end": list(os.getloadavg())})


if __name__ == "__main__":
    main()
