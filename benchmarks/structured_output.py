"""Structured output on a real model: does every answer parse and validate, and what do the
constraints cost?

Acceptance: one request per schema of `_json_schemas.schemas(seed, count)` (the seeded
generator, fixed before any tuning), each asking the model (chat template, greedy) to fill
in the schema given in the prompt, constrained to it by `response_format`-style JSON-schema
decoding; all run together through the engine (continuous batching). Reported: how many
finished, parsed as JSON and validated against their schema (`jsonschema`).

Cost: the first `--speed-requests` of those requests again at batch 1 (one at a time) and at
batch 8, constrained and unconstrained, the unconstrained ones generating exactly as many
tokens as their constrained twin (ignore_eos, max_tokens = that count): output tok/s of each,
and the ratio.

    python benchmarks/structured_output.py --artifact out/q4_1 [--count 100] [--threads 2]
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
          batch: int) -> tuple[float, int]:
    """(seconds, output tokens) of running the requests `batch` at a time."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[i : i + batch], params[i : i + batch])
        tokens += sum(len(o.token_ids) for o in outputs)
    return time.perf_counter() - start, tokens


def speed(llm: LLM, prompts: list[list[int]], outputs: list[RequestOutput],
          cases: list[dict[str, Any]], max_tokens: int, penalty: float) -> list[dict[str, Any]]:
    """tok/s with and without constraints at batch 1 and 8, the same token counts."""
    rows = []
    plain = [SamplingParams(max_tokens=len(o.token_ids), temperature=0.0, ignore_eos=True,
                            repetition_penalty=penalty) for o in outputs]
    with_grammar = [constrained(s, max_tokens, penalty) for s in cases]
    for batch in (1, 8):
        seconds_c, tokens_c = timed(llm, prompts, with_grammar, batch)
        seconds_p, tokens_p = timed(llm, prompts, plain, batch)
        rows.append({"batch": batch, "tokens": tokens_c,
                     "constrained_tok_s": round(tokens_c / seconds_c, 1),
                     "unconstrained_tok_s": round(tokens_p / seconds_p, 1),
                     "ratio": round((tokens_c / seconds_c) / (tokens_p / seconds_p), 3)})
        assert tokens_c == tokens_p, (tokens_c, tokens_p)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--speed-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="HF's, over prompt and output (1: off)")
    args = parser.parse_args()
    llm = LLM(args.artifact, num_threads=args.threads, max_num_seqs=16)
    cases = schemas(args.seed, args.count)
    prompts = [prompt_ids(llm, s) for s in cases]
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
    result = {"machine": machine_info(("llguidance", "jsonschema")),
              "args": vars(args) | {"artifact": str(args.artifact)}, "valid": valid,
              "finished": finished, "count": args.count, "verdicts": verdicts,
              "seconds": seconds, "tokens": tokens, "texts": [o.text for o in outputs]}
    out = RESULTS_DIR / f"structured_output_rp{penalty}.json"
    write_json(out, result)
    n = args.speed_requests
    if not n:
        return
    rows = speed(llm, prompts[:n], outputs[:n], cases[:n], args.max_tokens, penalty)
    print(f"\nthroughput, {n} requests ({sum(len(o.token_ids) for o in outputs[:n])} tokens), "
          f"{llm.execution_summary()}, load {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'constrained tok/s':>18} {'unconstrained tok/s':>20} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:5d} {r['constrained_tok_s']:18.1f} {r['unconstrained_tok_s']:20.1f} "
              f"{r['ratio']:6.3f}")
    write_json(out, result | {"speed": rows, "loadavg_at_end": list(os.getloadavg())})


if __name__ == "__main__":
    main()
