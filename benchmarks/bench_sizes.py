"""Real model sizes: compile cost, load cost and decode speed against llama.cpp Q4_0.

    python benchmarks/bench_sizes.py --shapes llama-3.2-1b,llama-3.1-8b --ckpt-dir /work/ckpt \
        --out-dir /work/sizes --threads 1 [--llama-cpp BUILD_DIR --convert CONVERT_PY]

For each shape: a random-weight checkpoint (`real_shapes.py`, written on first use), compiled
with the fast RTN recipe (int4 g32 symmetric, 8-bit LM head, int8 activations, int8 KV with
static channel scales calibrated on `--calib-samples` x 256 tokens of `--calib-text`) in a
fresh process under `/usr/bin/time` (wall time, peak RSS); the artifact's size; loading it in
a fresh process (seconds, RSS after load); then batch-1 decode, batch-8 aggregate decode and
prefill (prompt 128, 64 new tokens, random ids). With `--llama-cpp`, the same weights
converted by llama.cpp's `convert_hf_to_gguf.py` (bf16) and quantized by its `llama-quantize`
to Q4_0 run under `llama-bench` (prefill, b1 decode) and `llama-batched-bench` (b8), same
threads. The batch-1 bound is the read bandwidth (the best of numpy and the native step's
prefetching read loop, over 1 GiB, measured just before each system's run so both see the
machine's load of that moment) over each system's bytes read per token. Writes
benchmarks/results/bench_sizes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _bandwidth_bound import (
    gguf_weight_bytes,
    llmopt_model_file,
    native_read_bandwidth_gb_s,
    onnx_weight_bytes,
    read_bandwidth_gb_s,
)
from _common import RESULTS_DIR, machine_info, thread_env, write_json
from real_shapes import SHAPES, write_checkpoint

PROMPT, GEN = 128, 64
RECIPE = """model: {model}
passes:
  - kv_cache: {{dtype: int8, key_scales: channel, value_scales: channel, rotate: false,
                calibration_samples: {samples}}}
  - rtn: {{bits: 4, group_size: 32, symmetric: true, include_lm_head: true, lm_head_bits: 8}}
calibration: {{text: {text}, samples: {samples}, seq_len: 256}}
target: {{nbits_accuracy_level: 4}}
quality: {{measure: false}}
runtime: {{max_context: 2048, max_num_seqs: 8}}
"""


def timed_process(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `command` under /usr/bin/time -v: wall seconds, peak RSS GiB, its stdout."""
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise RuntimeError(f"{command[:3]} failed with exit code {proc.returncode}")
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)[1])
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr)[1]
    seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall.split(":"))))
    return {"seconds": round(seconds, 1), "peak_rss_gib": round(rss_kib / 2**20, 2),
            "stdout": proc.stdout}


def compile_llmopt(shape: str, checkpoint: Path, out_dir: Path, args: argparse.Namespace
                   ) -> tuple[Path, dict[str, Any]]:
    artifact = out_dir / f"{shape}-rtn"
    recipe = out_dir / f"{shape}-rtn.yaml"
    recipe.write_text(RECIPE.format(model=checkpoint, samples=args.calib_samples,
                                    text=args.calib_text))
    if (artifact / "manifest.json").exists() and not args.recompile:
        return artifact, {}
    llmopt = Path(sys.executable).parent / "llmopt"
    result = timed_process([str(llmopt), "compile", str(recipe), "-o", str(artifact)])
    return artifact, {"compile_seconds": result["seconds"],
                      "compile_peak_rss_gib": result["peak_rss_gib"]}


def llmopt_worker(artifact: Path, threads: int) -> dict[str, Any]:
    """Load the artifact and time it, in this process (called in a fresh one)."""
    from llmopt.runtime import LLM
    from llmopt.tools.bench import run_bench

    started = time.perf_counter()
    llm = LLM(str(artifact), num_threads=threads)
    load_seconds = time.perf_counter() - started
    rss, peak = _rss_gib(), _rss_gib("VmHWM")  # after loading, and the peak while loading
    b1, b8 = run_bench(llm, 1, PROMPT, GEN), run_bench(llm, 8, PROMPT, GEN)
    return {"load_seconds": round(load_seconds, 1), "load_rss_gib": round(rss, 2),
            "load_peak_rss_gib": round(peak, 2),
            "kernels": llm.execution_summary(),
            "prefill_tok_s": round(PROMPT / (b1.ttft_ms / 1000), 1),
            "b1_tok_s": round(b1.decode_tok_s_per_stream, 2),
            "b8_tok_s": round(b8.decode_aggregate_tok_s, 2)}


def _rss_gib(field: str = "VmRSS") -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(field + r":\s+(\d+) kB", status)[1]) / 2**20


def llama_cpp(checkpoint: Path, out_dir: Path, shape: str, args: argparse.Namespace
              ) -> tuple[Path, dict[str, Any]]:
    """Q4_0 of the same weights by llama.cpp's own tools, and its speeds."""
    build = Path(args.llama_cpp)
    q4 = out_dir / f"{shape}-q4_0.gguf"
    if not q4.exists():
        bf16 = out_dir / f"{shape}-bf16.gguf"
        subprocess.run([sys.executable, args.convert, str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(bf16)], check=True, capture_output=True)
        subprocess.run([str(build / "llama-quantize"), str(bf16), str(q4), "Q4_0"], check=True,
                       capture_output=True)
        bf16.unlink()  # 2 bytes a parameter: the disk is better spent on the next shape
    threads = str(args.threads)
    bench = subprocess.run([str(build / "llama-bench"), "-m", str(q4), "-t", threads,
                            "-p", str(PROMPT), "-n", str(GEN), "-r", "2", "-o", "json"],
                           check=True, capture_output=True, text=True)
    rows = json.loads(bench.stdout)
    speeds = {("prefill" if r["n_prompt"] else "b1"): r["avg_ts"] for r in rows}
    batched = subprocess.run([str(build / "llama-batched-bench"), "-m", str(q4), "-t", threads,
                              "-c", "4096", "-npp", str(PROMPT), "-ntg", str(GEN),
                              "-npl", "8", "--output-format", "jsonl"],
                             check=True, capture_output=True, text=True)
    b8 = json.loads(batched.stdout.strip().splitlines()[-1])["speed_tg"]
    return q4, {"prefill_tok_s": round(speeds["prefill"], 1), "b1_tok_s": round(speeds["b1"], 2),
                "b8_tok_s": round(b8, 2), "size_gib": round(q4.stat().st_size / 2**30, 2)}


def read_rate_gb_s(threads: int) -> float:
    """The best read bandwidth numpy or the native step's read loop draws now."""
    native = native_read_bandwidth_gb_s(threads, 1024, 5) or []
    return max([*read_bandwidth_gb_s(threads, 1024, 5), *native])


def measure_shape(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = args.ckpt_dir / shape
    if not (checkpoint / "config.json").exists():
        write_checkpoint(shape, checkpoint)
    artifact, row = compile_llmopt(shape, checkpoint, args.out_dir, args)
    row["artifact_gib"] = round(sum(f.stat().st_size for f in artifact.iterdir()) / 2**30, 2)
    row["read_gb_s"] = bandwidth = read_rate_gb_s(args.threads)
    worker = timed_process([sys.executable, __file__, "--worker", str(artifact),
                            "--threads", str(args.threads)], env=thread_env(args.threads))
    row |= json.loads(worker["stdout"].strip().splitlines()[-1])
    read_bytes = sum(onnx_weight_bytes(llmopt_model_file(artifact)).values())
    row["b1_bound_tok_s"] = round(bandwidth * 1e9 / read_bytes, 2)
    row["b1_fraction_of_bound"] = round(row["b1_tok_s"] / row["b1_bound_tok_s"], 3)
    if args.llama_cpp:
        cpp_bandwidth = read_rate_gb_s(args.threads)
        q4, cpp = llama_cpp(checkpoint, args.out_dir, shape, args)
        cpp["read_gb_s"] = cpp_bandwidth
        cpp_bound = cpp_bandwidth * 1e9 / sum(gguf_weight_bytes(q4).values())
        cpp["b1_fraction_of_bound"] = round(cpp["b1_tok_s"] / cpp_bound, 3)
        row["llama.cpp"] = cpp
        row["b1_vs_llama_cpp"] = round(row["b1_tok_s"] / cpp["b1_tok_s"], 2)
        row["b8_vs_llama_cpp"] = round(row["b8_tok_s"] / cpp["b8_tok_s"], 2)
    return row


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    print("| shape | compile s | compile peak GiB | artifact GiB | load s | load RSS (peak) GiB "
          "| prefill tok/s | b1 tok/s (bound) | b8 tok/s | llama.cpp b1 / b8 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, r in rows.items():
        cpp = r.get("llama.cpp", {})
        print(f"| {shape} | {r.get('compile_seconds', '-')} | {r.get('compile_peak_rss_gib', '-')} "
              f"| {r['artifact_gib']} | {r['load_seconds']} "
              f"| {r['load_rss_gib']} ({r.get('load_peak_rss_gib', '-')}) "
              f"| {r['prefill_tok_s']} | {r['b1_tok_s']} ({r['b1_bound_tok_s']}) "
              f"| {r['b8_tok_s']} | {cpp.get('b1_tok_s', '-')} / {cpp.get('b8_tok_s', '-')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b")
    parser.add_argument("--ckpt-dir", type=Path, default=Path("out/ckpt"))
    parser.add_argument("--out-dir", type=Path, default=Path("out/sizes"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calib-text", default=str(Path(__file__).resolve().parents[2] / "shared"
                                                    / "data" / "wikitext2-valid.tokens.txt"))
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--llama-cpp", help="a llama.cpp build's bin directory")
    parser.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--recompile", action="store_true")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(llmopt_worker(args.worker, args.threads)))
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()  # its load average is the start's
    rows = {shape: measure_shape(shape, args) for shape in args.shapes.split(",")
            if shape in SHAPES or sys.exit(f"unknown shape {shape}; one of {sorted(SHAPES)}")}
    print_table(rows)
    write_json(RESULTS_DIR / "bench_sizes.json",
               {"machine": machine, "threads": args.threads,
                "loadavg_at_end": list(os.getloadavg()), "rows": rows})


if __name__ == "__main__":
    main()
