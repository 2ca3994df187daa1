"""bench_int4 --profile: where a system's batch-1 decode step spends its time (ORT profiler)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _common import write_json
from bench_foundation import WARMUP_GEN_LEN, parse_ints, prompt_seed


def profile_main(args: argparse.Namespace, system: str, target: str, llmopt: bool) -> None:
    """Batch-1 generation with ONNX Runtime's profiler on (an llmopt artifact or the ORT
    GenAI model): per decode step, wall time vs session run vs kernel time, and kernel time
    per operator type and per node."""
    threads = parse_ints(args.threads)[0]
    prefix = str(Path(args.json).with_suffix("")) + f"-{system}"
    profile = profile_llmopt if llmopt else profile_ort_genai
    trace, step_s, decode_tok_s = profile(target, threads, prefix, args)
    report = {"system": system, "target": target, "threads": threads,
              "decode_tok_s": decode_tok_s, "step_wall_ms": 1000 * statistics.median(step_s),
              **trace_summary(trace, args.gen_len - 1), "trace": trace,
              "loadavg": list(os.getloadavg())}
    print(f"{system}: decode {decode_tok_s:.1f} tok/s; median decode step "
          f"{report['step_wall_ms']:.2f} ms wall = {report['model_run_ms']:.2f} ms session run "
          f"({report['kernel_ms']:.2f} ms mean in kernels) + "
          f"{report['step_wall_ms'] - report['model_run_ms']:.2f} ms outside the graph; "
          f"load {report['loadavg'][0]:.2f}")
    for op, ms in report["per_op_ms"].items():
        print(f"  {op:<36} {ms:7.3f} ms/step")
    write_json(Path(args.json), report)
    print(f"wrote {args.json}")


def trace_summary(trace: str, decode_steps: int) -> dict[str, Any]:
    """Per decode step of the timed generation (its last `decode_steps` session runs):
    session run time, kernel time, and kernel time per operator type and per node."""
    events = json.loads(Path(trace).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    decode_runs = runs[-decode_steps:]
    start, end = decode_runs[0]["ts"], decode_runs[-1]["ts"] + decode_runs[-1]["dur"]
    per_op: dict[str, float] = {}
    per_node: dict[str, float] = {}
    for e in events:
        if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                and start <= e["ts"] <= end):
            op = e["args"].get("op_name", "?")
            per_op[op] = per_op.get(op, 0.0) + e["dur"]
            per_node[e["name"]] = per_node.get(e["name"], 0.0) + e["dur"]
    n = len(decode_runs)
    return {
        "decode_steps": n,
        "model_run_ms": statistics.median(r["dur"] for r in decode_runs) / 1000,
        "kernel_ms": sum(per_op.values()) / n / 1000,
        "per_op_ms": {op: t / n / 1000 for op, t in sorted(per_op.items(), key=lambda x: -x[1])},
        "top_nodes_ms": {name: t / n / 1000 for name, t in
                         sorted(per_node.items(), key=lambda x: -x[1])[:30]},
    }


def profile_llmopt(artifact: str, threads: int, prefix: str,
                   args: argparse.Namespace) -> tuple[str, list[float], float]:
    import llmopt.runtime.executors.gathered as executor
    from llmopt.runtime import LLM
    from llmopt.tools.bench import run_bench

    original = executor.session_options

    def profiled(*a: Any, **k: Any) -> Any:
        options = original(*a, **k)
        options.enable_profiling = True
        options.profile_file_prefix = prefix
        return options

    executor.session_options = profiled  # LLM builds its session through this function
    llm = LLM(artifact, num_threads=threads, max_num_seqs=1,
              max_context=args.prompt_len + args.gen_len + 1)
    run_bench(llm, 1, args.prompt_len, WARMUP_GEN_LEN, seed=prompt_seed(1, True))
    steps: list[float] = []
    step = llm.engine.step

    def timed_step() -> Any:
        started = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - started)
        return out

    llm.engine.step = timed_step
    result = run_bench(llm, 1, args.prompt_len, args.gen_len, seed=prompt_seed(1, False))
    trace = llm.engine.executor.session.end_profiling()
    return trace, steps[-(args.gen_len - 1):], result.decode_tok_s_per_stream


def profile_ort_genai(model_dir: str, threads: int, prefix: str,
                      args: argparse.Namespace) -> tuple[str, list[float], float]:
    import gc
    import glob

    import numpy as np
    import onnxruntime_genai as og

    from llmopt.tools.bench import bench_prompts

    config = og.Config(model_dir)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1,
        "enable_profiling": prefix}}}}))
    model = og.Model(config)
    steps: list[float] = []
    for new_tokens, warmup in ((WARMUP_GEN_LEN, True), (args.gen_len, False)):
        ids = np.asarray(bench_prompts(49152, 1, args.prompt_len, prompt_seed(1, warmup)),
                         dtype=np.int32)
        params = og.GeneratorParams(model)
        length = args.prompt_len + new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        steps = []
        for _ in range(new_tokens - 1):
            started = time.perf_counter()
            generator.generate_next_token()
            steps.append(time.perf_counter() - started)
        del generator
    del model
    gc.collect()  # the session writes its trace when it is destroyed
    trace = max(glob.glob(prefix + "*.json"), key=os.path.getmtime)
    return trace, steps, len(steps) / sum(steps)
