"""Soak `llmopt serve`: many requests from many concurrent clients, some cancelled mid-stream.

Checks: no request lost or failed, every greedy completion identical to the offline
`LLM.generate` of the same prompt (a cancelled one: a prefix of it), the KV pool back to
zero used blocks and no request left running or waiting, and the server's RSS after
warm-up. Prints a summary and writes benchmarks/results/soak_serve.json.

    python benchmarks/soak_serve.py out/smollm2-int4-spec --requests 1000 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from _serve_client import ServerProcess, StreamResult, stream_completion  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2-valid.tokens.txt"
MODEL = "soak"


def make_prompts(tokenizer: Any, count: int, seed: int) -> list[str]:
    """Distinct prompts of 8-200 tokens: WikiText passages, or plain words without it."""
    rng = random.Random(seed)
    words = (TEXT.read_text() if TEXT.is_file() else "the quick brown fox " * 5000).split()
    prompts = []
    for _ in range(count):
        start = rng.randrange(len(words) - 400)
        ids = tokenizer.encode(" ".join(words[start : start + 300]), add_bos=False)
        prompts.append(tokenizer.decode(ids[: rng.randint(8, 200)]))
    return prompts


def offline_outputs(artifact: str, prompts: list[str], max_tokens: int,
                    llm_kwargs: dict[str, Any]) -> tuple[list[list[int]], Any]:
    from llmopt.runtime import LLM, SamplingParams

    llm = LLM(artifact, **llm_kwargs)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.token_ids for o in outputs], llm.tokenizer


async def soak(url: str, specs: list[dict[str, Any]], clients: int) -> list[StreamResult]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    results: list[StreamResult | None] = [None] * len(specs)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            spec = specs[i]
            results[i] = await stream_completion(client, url, spec["body"], spec["cancel_after"])

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return [r for r in results if r is not None]


def sample_rss(server: ServerProcess, samples: list[tuple[float, float]], stop: Any) -> None:
    while not stop.is_set():
        samples.append((time.perf_counter(), server.rss_mib()))
        stop.wait(1.0)


def check(specs: list[dict[str, Any]], results: list[StreamResult],
          expected: list[list[int]], tokenizer: Any) -> dict[str, Any]:
    failed, mismatched = [], []
    for spec, result in zip(specs, results, strict=True):
        if not result.ok and not result.cancelled:
            failed.append(result.error)
            continue
        want = tokenizer.decode(expected[spec["prompt"]][: spec["body"]["max_tokens"]])
        same = want.startswith(result.text) if result.cancelled else want == result.text
        if not same:
            mismatched.append({"prompt": spec["prompt"], "got": result.text[:80],
                               "want": want[:80]})
    return {"lost": len(specs) - len(results), "failed": len(failed),
            "failed_errors": sorted({str(e) for e in failed})[:5],
            "mismatched": len(mismatched), "mismatch_examples": mismatched[:3],
            "cancelled": sum(r.cancelled for r in results)}


def llmopt_cli() -> str:
    """The `llmopt` script of this interpreter's environment."""
    return str(Path(sys.executable).with_name("llmopt"))


def server_state(base: str) -> dict[str, float]:
    wanted = ("llmopt_kv_cache_used_blocks", "llmopt_num_requests_running",
              "llmopt_num_requests_waiting", "llmopt_requests_total")
    state = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        name = line.split("{", 1)[0]
        if name in wanted:
            outcome = re.search(r'outcome="(\w+)"', line)
            state[name + (f"[{outcome.group(1)}]" if outcome else "")] = float(line.split()[-1])
    return state


def main() -> None:
    args = parse_args()
    import threading

    llm_kwargs = {"num_threads": args.threads, "speculative": args.speculative}
    rng = random.Random(args.seed)
    from llmopt.runtime.artifact import load_manifest
    from llmopt.runtime.tokenizer import Tokenizer

    manifest = load_manifest(Path(args.artifact))
    tokenizer = Tokenizer.from_file(Path(args.artifact) / manifest.tokenizer.file,
                                    manifest.tokenizer)
    prompts = make_prompts(tokenizer, args.prompts, args.seed)
    print(f"offline greedy reference for {len(prompts)} prompts ...", flush=True)
    expected, tokenizer = offline_outputs(args.artifact, prompts, args.max_tokens, llm_kwargs)
    specs = []
    for _ in range(args.requests):
        p, m = rng.randrange(len(prompts)), rng.randint(4, args.max_tokens)
        cancel = rng.randint(1, max(1, m - 2)) if rng.random() < args.cancel else None
        specs.append({"prompt": p, "cancel_after": cancel, "body": {
            "model": MODEL, "prompt": prompts[p], "max_tokens": m, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}})
    port, base = args.port, f"http://127.0.0.1:{args.port}"
    command = [llmopt_cli(), "serve", args.artifact, "--port", str(port),
               "--served-model-name", MODEL, "--threads", str(args.threads),
               "--speculative" if args.speculative else "--no-speculative"]
    rss: list[tuple[float, float]] = []
    with ServerProcess(command, f"{base}/health", RESULTS_DIR / "soak_serve.log") as server:
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(server, rss, stop), daemon=True)
        sampler.start()
        started = time.perf_counter()
        print(f"{args.requests} requests from {args.clients} clients ...", flush=True)
        results = asyncio.run(soak(f"{base}/v1/completions", specs, args.clients))
        wall = time.perf_counter() - started
        time.sleep(0.5)  # let the last aborts land
        state = server_state(base)
        stop.set()
        sampler.join()
    report = summary(args, specs, results, expected, tokenizer, state, rss, started, wall)
    report["server_exit_code"] = server.exit_code
    report["machine"] = machine_info()
    report["loadavg_at_end"] = list(os.getloadavg())
    write_json(RESULTS_DIR / "soak_serve.json", report)
    for key, value in report.items():
        if key != "machine":
            print(f"{key}: {value}")


def summary(args: argparse.Namespace, specs: list[dict[str, Any]], results: list[StreamResult],
            expected: list[list[int]], tokenizer: Any, state: dict[str, float],
            rss: list[tuple[float, float]], started: float, wall: float) -> dict[str, Any]:
    warm = started + wall * 0.1  # RSS after the first tenth of the run counts as warmed up
    after = [mib for t, mib in rss if t >= warm] or [0.0]
    return {
        "requests": args.requests, "clients": args.clients, "cancel_fraction": args.cancel,
        "speculative": args.speculative, "wall_s": round(wall, 1),
        **check(specs, results, expected, tokenizer),
        "server_state_at_end": state,
        "rss_mib_at_warmup": round(after[0], 1), "rss_mib_at_end": round(after[-1], 1),
        "rss_mib_max_after_warmup": round(max(after), 1),
        "output_tokens": sum(r.num_tokens for r in results if r.ok),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--cancel", type=float, default=0.1, help="fraction cancelled")
    parser.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    main()
