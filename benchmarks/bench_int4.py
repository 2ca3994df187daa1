"""llmopt int4 artifacts against llama.cpp and ONNX Runtime GenAI int4 on SmolLM2-135M-Instruct.

    python benchmarks/bench_int4.py --rounds 3 --threads 1,2 --out-dir /work/bench-out

One run reports, side by side: batch 1/4/8/16 at prompt 128 / gen 128 (prefill, decode,
aggregate over the whole run and over its decode phase — once every stream has its first
token, the anchors' "decode tok/s (aggregate)" — peak RSS), batch-1 decode at prompts
128/512/1024/1900 (gen 64), and the batch-1 bound = this machine's read bandwidth (measured
each round) / each system's bytes per token.
Bandwidth is read over --bandwidth-mib (DRAM) and over an array the size of the systems'
weights per token (a decode step re-reads that working set every token; the bounds use it),
each by numpy and by the native kernels' prefetching read loop, the best counting
(numpy's single dependent stream understates a CPU that needs prefetching). Batched runs of
native artifacts get their arithmetic floor beside it: the run's int8 multiply-adds over the
cores' measured dot rate (_arithmetic_bound.py), and the batch-16 / own batch-1 ratio that
floor would allow.

Systems (each worker a fresh subprocess, greedy, EOS ignored, same random prompts):
  llmopt-fp32          recipes/smollm2-135m-instruct.yaml as is (the same-run baseline)
  llmopt-q4_1          gguf_weights: the file's own Q4_1 blocks, float LM head, accuracy level 0
  llmopt-q4_1-a8       gguf_weights + the file's Q8_0 LM head, accuracy level 4 (int8 activations)
  llmopt-rtn4-a8       one rtn pass: int4 sym g32 decoder linears, 8-bit LM head, level 4
  llmopt-rtn4-a8-blocks  the same over the gathered blocks KV layout (the old hot path)
  llmopt-rtn4-h4-a8    the same with a 4-bit LM head (fewer bytes per token)
  llmopt-rtn4-a8-dq    rtn4-a8 lowered as DequantizeLinear -> MatMul (ORT fuses them)
  llmopt-q4_1-a8-native, llmopt-rtn4-a8-native, llmopt-rtn4-h4-a8-native
                       those artifacts run by llmopt's native step (--kernels native)
  llmopt-rtn4-h4-a8-kv8-native  rtn4-h4-a8 after the kv_cache pass: int8 KV lanes (static
                       channel scales calibrated on the validation split), native
  llmopt-rtn4-h4-a8-kv4-native  ... int4 KV lanes, the 6 most sensitive layers in int8
  llmopt-gptq4-g128-h4-a8-kv8-native  gptq instead of rtn: int4 sym in blocks of 128 (act
                       order, 128 x 512 calibration tokens of the validation split), 4-bit LM
                       head, int8 KV lanes: a quarter of g32's float work per multiply-add
  llmopt-gptq4-g128-h8-a8-kv8-native  ... with an 8-bit LM head (llama.cpp Q4_0's head width)
  llama.cpp-q4_1       llama-cpp-python on the package's own Q4_1 GGUF
  llama.cpp-q4_0       the same weights as an F32 GGUF, re-quantized by llama.cpp to Q4_0
  llama.cpp-q8_0       ... and to Q8_0
  ort-genai-int4       onnxruntime-genai's model builder, `-p int4 -e cpu`, on the fp32 HF dir
Missing artifacts and competitor models are built first under --out-dir.
llama.cpp runs through its C-API bindings: one `llama_batch` carrying every sequence's prompt,
then one `llama_batch` of `batch` tokens per decode step, greedy argmax over the logits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _arithmetic_bound import dot_rate_g_macs, native_plan, run_macs
from _bandwidth_bound import (
    gguf_kv_bytes_per_position,
    gguf_weight_bytes,
    llmopt_kv_bytes_per_position,
    llmopt_model_file,
    native_read_bandwidth_gb_s,
    onnx_weight_bytes,
    ort_genai_kv_bytes_per_position,
    ort_genai_model_file,
    read_bandwidth_gb_s,
)
from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    compile_artifact,
    machine_info,
    median_rows,
    process_peak_rss_mib,
    run_json_worker,
    thread_env,
    write_json,
)
from _core_latency import core_round_trip_ns
from _int4_models import (
    ensure_f32_gguf,
    ensure_hf_dir,
    ensure_llama_quant,
    ensure_ort_genai,
    package_gguf,
)
from _int4_profile import profile_main
from bench_foundation import WARMUP_GEN_LEN, parse_ints, prompt_seed, ratio

DEFAULT_RECIPE = "recipes/smollm2-135m-instruct.yaml"
# One weight pass: rtn int4 sym g32 decoder linears, the LM head at its own width.
RTN4 = "{rtn: {bits: 4, group_size: 32, symmetric: true, include_lm_head: true, lm_head_bits: %d}}"
A8 = "target.nbits_accuracy_level=4"
# The kv_cache pass before rtn; static scales are calibrated on the validation split, as
# every benchmark calibrates. No `rotate`: folded into v_proj/o_proj before rtn, the rotation
# costs these int4 weights perplexity (benchmarks/README.md).
KV8 = "{kv_cache: {dtype: int8, key_scales: channel, value_scales: channel}}"
KV4 = ("{kv_cache: {dtype: int4, key_scales: channel, value_scales: channel, "
       "skip_dtype: int8, auto_skip: 6}}")
GPTQ128 = ("{gptq: {bits: 4, group_size: 128, symmetric: true, include_lm_head: true, "
           "lm_head_bits: %d}}")
VALID_SPLIT = REPO_ROOT.parent / "shared" / "data" / "wikitext2-valid.tokens.txt"
CALIBRATION = f"calibration.text={VALID_SPLIT}"
# llmopt system -> (artifact directory name under --out-dir, recipe overrides)
ARTIFACTS: dict[str, tuple[str, list[str]]] = {
    "llmopt-fp32": ("smollm2", []),
    "llmopt-q4_1": ("smollm2-gguf-q4_1", ["passes=[{gguf_weights: {include_lm_head: false}}]"]),
    "llmopt-q4_1-a8": ("smollm2-gguf-q4_1-q8head-a8",
                       ["passes=[{gguf_weights: {include_lm_head: true}}]", A8]),
    "llmopt-rtn4-a8": ("smollm2-rtn4-sym-g32-h8-a8", [f"passes=[{RTN4 % 8}]", A8]),
    # The same weights over the gathered blocks KV layout: the hot path before lanes.
    "llmopt-rtn4-a8-blocks": ("smollm2-rtn4-sym-g32-h8-a8-blocks",
                              [f"passes=[{RTN4 % 8}]", A8, "target.kv_layout=blocks"]),
    "llmopt-rtn4-h4-a8": ("smollm2-rtn4-sym-g32-h4-a8", [f"passes=[{RTN4 % 4}]", A8]),
    # The same artifacts run by llmopt's native decoder step (--kernels native).
    "llmopt-q4_1-a8-native": ("smollm2-gguf-q4_1-q8head-a8",
                              ["passes=[{gguf_weights: {include_lm_head: true}}]", A8]),
    "llmopt-rtn4-a8-native": ("smollm2-rtn4-sym-g32-h8-a8", [f"passes=[{RTN4 % 8}]", A8]),
    "llmopt-rtn4-h4-a8-native": ("smollm2-rtn4-sym-g32-h4-a8", [f"passes=[{RTN4 % 4}]", A8]),
    "llmopt-rtn4-h4-a8-kv8-native": ("smollm2-rtn4-sym-g32-h4-a8-kv8",
                                     [f"passes=[{KV8}, {RTN4 % 4}]", A8, CALIBRATION]),
    "llmopt-rtn4-h4-a8-kv4-native": ("smollm2-rtn4-sym-g32-h4-a8-kv4",
                                     [f"passes=[{KV4}, {RTN4 % 4}]", A8, CALIBRATION]),
    "llmopt-gptq4-g128-h4-a8-kv8-native": ("smollm2-gptq4-sym-g128-h4-a8-kv8",
                                           [f"passes=[{KV8}, {GPTQ128 % 4}]", A8,
                                            CALIBRATION]),
    # ... with an 8-bit LM head: Q4_0's bytes per token (its head is Q8_0), better quality
    "llmopt-gptq4-g128-h8-a8-kv8-native": ("smollm2-gptq4-sym-g128-h8-a8-kv8",
                                           [f"passes=[{KV8}, {GPTQ128 % 8}]", A8,
                                            CALIBRATION]),
    "llmopt-rtn4-a8-dq": ("smollm2-rtn4-sym-g32-h8-a8-dq",
                          [f"passes=[{RTN4 % 8}]", A8,
                           "target.quantized_matmul=dequantize_linear"]),
}
# llama.cpp system -> GGUF file name under --out-dir (Q4_1: the package's own file)
LLAMA_CPP = {"llama.cpp-q4_1": None, "llama.cpp-q4_0": "smollm2-q4_0.gguf",
             "llama.cpp-q8_0": "smollm2-q8_0.gguf"}
Q4_0, Q4_1, OG = "llama.cpp-q4_0", "llama.cpp-q4_1", "ort-genai-int4"
SYSTEMS = (*ARTIFACTS, *LLAMA_CPP, OG)
# The comparison: llmopt's int4 artifacts, llama.cpp Q4_0 and Q4_1, ORT GenAI int4.
DEFAULT_SYSTEMS = ("llmopt-q4_1", "llmopt-q4_1-a8", "llmopt-rtn4-a8", "llmopt-rtn4-h4-a8",
                   Q4_0, Q4_1, OG)
INT4_LLMOPT = ("llmopt-q4_1", "llmopt-q4_1-a8", "llmopt-rtn4-a8", "llmopt-rtn4-h4-a8",
               "llmopt-rtn4-a8-dq", "llmopt-q4_1-a8-native", "llmopt-rtn4-a8-native",
               "llmopt-rtn4-h4-a8-native", "llmopt-rtn4-h4-a8-kv8-native",
               "llmopt-rtn4-h4-a8-kv4-native", "llmopt-gptq4-g128-h4-a8-kv8-native",
               "llmopt-gptq4-g128-h8-a8-kv8-native")
# lossless: the same blocks as llama.cpp-q4_1
Q4_1_LLMOPT = ("llmopt-q4_1", "llmopt-q4_1-a8", "llmopt-q4_1-a8-native")
ANCHORS = (Q4_0, Q4_1, "llama.cpp-q8_0", OG)
TARGET = 1.2  # batch-8 aggregate vs the anchors
BANDWIDTH = "bandwidth"  # the read-bandwidth probe's worker, run like a system
BANDWIDTH_REPEATS = 5
# llama-cpp-python is installed without its shared library; a native build of the same
# llama.cpp version (used when LLAMA_CPP_LIB_PATH is not set).
LLAMA_CPP_LIB_DIR = "/tmp/serve-build/lcpp/bin"
METRICS = ("prefill_ms", "decode_tok_s_per_stream", "aggregate_tok_s", "decode_aggregate_tok_s",
           "peak_rss_mib")


# ---- workers: one system, one mode (batch sizes or contexts), one JSON line ------------

Case = tuple[int, int, int]  # (batch, prompt_len, gen_len)


def worker_main(spec: dict[str, str], args: argparse.Namespace) -> None:
    threads, system, mode = int(spec["threads"]), spec["system"], spec["mode"]
    started = time.perf_counter()
    if mode == "bandwidth":
        results: list[dict[str, Any]] = [bandwidth_probes(threads, args)]
    else:
        run = (run_llmopt if system in ARTIFACTS else run_llama_cpp if system in LLAMA_CPP
               else run_ort_genai)
        results = run(spec, threads, mode_cases(mode, args))
    print(json.dumps({"system": system, "mode": mode, "threads": threads, "results": results,
                      "worker_s": time.perf_counter() - started}), flush=True)


def bandwidth_probes(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """Read GB/s over the weights-sized array and over the DRAM-sized one, by numpy and by
    the native read loop (None without it); `working_set_gb_s` and `gb_s` are the best any
    reader reached: what a decode step could draw from this machine's memory system."""
    probes: dict[str, Any] = {}
    # The working set first: the DRAM probe's gigabyte would evict it from the cache.
    for size, mib, repeats in (("working_set", args.working_set_mib, 4 * BANDWIDTH_REPEATS),
                               ("dram", args.bandwidth_mib, BANDWIDTH_REPEATS)):
        probes[f"numpy_{size}"] = read_bandwidth_gb_s(threads, mib, repeats)
        probes[f"native_{size}"] = native_read_bandwidth_gb_s(threads, mib, repeats)
    best = {size: max(max(probes[f"{reader}_{size}"] or [0.0]) for reader in ("numpy", "native"))
            for size in ("working_set", "dram")}
    return {"gb_s": best["dram"], "working_set_gb_s": best["working_set"],
            "samples_gb_s": probes, "dot_g_macs": dot_rate_g_macs(threads)}


def mode_cases(mode: str, args: argparse.Namespace) -> list[Case]:
    """What a worker runs, ascending, so the peak RSS after each case is that case's peak:
    every batch size at --prompt-len, or batch 1 at every context (--context-gen-len)."""
    if mode == "batch":
        return [(batch, args.prompt_len, args.gen_len) for batch in parse_ints(args.batch)]
    return [(1, context, args.context_gen_len) for context in parse_ints(args.contexts)]


def case_seed(case: Case, warmup: bool) -> int:
    """Distinct prompts per case and for warm-ups: a longer prompt drawn from the same seed
    would start with a shorter one and hit llmopt's prefix cache."""
    batch, prompt_len, _ = case
    return 1000 * prompt_len + prompt_seed(batch, warmup)


def timed_result(case: Case, prefill_s: float, total_s: float) -> dict[str, float]:
    """The metrics of one greedy generation timed as: prefill (to the first token, every
    stream's at once), total."""
    batch, prompt_len, gen_len = case
    decode_s = total_s - prefill_s
    return {"batch": batch, "prompt_len": prompt_len, "prefill_ms": 1000 * prefill_s,
            "decode_tok_s_per_stream": (gen_len - 1) / decode_s,
            "aggregate_tok_s": batch * gen_len / total_s,
            "decode_aggregate_tok_s": batch * (gen_len - 1) / decode_s, "wall_s": total_s,
            "peak_rss_mib": process_peak_rss_mib()}


def run_llmopt(spec: dict[str, str], threads: int, cases: list[Case]) -> list[dict[str, float]]:
    """`llmopt.tools.bench.run_bench` per case: prefill = mean TTFT over the batch, decode =
    mean per-stream speed after the first token, decode aggregate = tokens per second once
    every stream has its first token (streams admitted early decode beside later prompts'
    prefill chunks, which their per-stream speed counts)."""
    from llmopt.runtime import LLM
    from llmopt.tools.bench import run_bench

    kernels = "native" if spec["system"].endswith("-native") else "onnxruntime"
    llm = LLM(spec["artifact"], num_threads=threads, max_num_seqs=max(c[0] for c in cases),
              max_context=max(c[1] + c[2] for c in cases) + 1, kernels=kernels)
    results = []
    for case in cases:
        batch, prompt_len, gen_len = case
        run_bench(llm, batch, prompt_len, WARMUP_GEN_LEN, seed=case_seed(case, True))
        r = run_bench(llm, batch, prompt_len, gen_len, seed=case_seed(case, False))
        results.append({"batch": batch, "prompt_len": prompt_len, "prefill_ms": r.ttft_ms,
                        "decode_tok_s_per_stream": r.decode_tok_s_per_stream,
                        "aggregate_tok_s": r.aggregate_tok_s,
                        "decode_aggregate_tok_s": r.decode_aggregate_tok_s, "wall_s": r.wall_s,
                        "peak_rss_mib": process_peak_rss_mib()})
    return results


def run_llama_cpp(spec: dict[str, str], threads: int, cases: list[Case]
                  ) -> list[dict[str, float]]:
    import llama_cpp as lc

    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(spec["model"].encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['model']}")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    results = []
    for case in cases:  # a fresh context per case, sized for its prompt + generation
        batch, prompt_len, gen_len = case
        ctx = LlamaCppBatch(lc, model, n_vocab, batch, prompt_len + gen_len, threads)
        ctx.generate(prompt_len, WARMUP_GEN_LEN, case_seed(case, True))
        prefill_s, total_s = ctx.generate(prompt_len, gen_len, case_seed(case, False))
        results.append(timed_result(case, prefill_s, total_s))
        ctx.free()
    lc.llama_model_free(model)
    return results


class LlamaCppBatch:
    """A llama.cpp context for `batch` parallel sequences, driven through the C API."""

    def __init__(self, lc: Any, model: Any, n_vocab: int, batch: int, seq_len: int,
                 threads: int):
        self.lc, self.n_vocab, self.batch = lc, n_vocab, batch
        params = lc.llama_context_default_params()
        per_seq = -(-(seq_len + 16) // 256) * 256
        params.n_ctx = batch * per_seq  # each sequence gets n_ctx / n_seq_max cells
        params.n_seq_max = batch
        params.n_batch = max(512, batch * seq_len)  # the whole batched prompt in one call
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.lc_batch = lc.llama_batch_init(params.n_batch, 0, batch)

    def generate(self, prompt_len: int, gen_len: int, seed: int) -> tuple[float, float]:
        """Greedy-generate `gen_len` tokens per sequence; seconds to the first token, total."""
        import numpy as np

        from llmopt.tools.bench import bench_prompts

        lc, b = self.lc, self.lc_batch
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        prompts = bench_prompts(self.n_vocab, self.batch, prompt_len, seed)
        started = time.perf_counter()
        rows = []
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                rows.append((token, pos, seq, pos == prompt_len - 1))
        self._fill(rows)
        logit_rows = [seq * prompt_len + prompt_len - 1 for seq in range(self.batch)]
        first = 0.0
        for step in range(gen_len):
            if lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            tokens = [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, row),
                                                shape=(self.n_vocab,)).argmax())
                      for row in logit_rows]
            if step == 0:
                first = time.perf_counter() - started
            if step == gen_len - 1:
                break
            self._fill([(tok, prompt_len + step, seq, True) for seq, tok in enumerate(tokens)])
            logit_rows = list(range(self.batch))
        return first, time.perf_counter() - started

    def _fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        b = self.lc_batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)

    def free(self) -> None:
        self.lc.llama_batch_free(self.lc_batch)
        self.lc.llama_free(self.ctx)


def run_ort_genai(spec: dict[str, str], threads: int, cases: list[Case]
                  ) -> list[dict[str, float]]:
    import onnxruntime_genai as og

    config = og.Config(spec["model"])
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    vocab_size = json.loads((Path(spec["model"]) / "genai_config.json").read_text()
                            )["model"]["vocab_size"]
    results = []
    for case in cases:
        batch, prompt_len, gen_len = case
        ort_genai_generate(og, model, vocab_size, (batch, prompt_len, WARMUP_GEN_LEN),
                           case_seed(case, True))
        prefill_s, total_s = ort_genai_generate(og, model, vocab_size, case,
                                                case_seed(case, False))
        results.append(timed_result(case, prefill_s, total_s))
    return results


def ort_genai_generate(og: Any, model: Any, vocab_size: int, case: Case, seed: int
                       ) -> tuple[float, float]:
    """Greedy-generate the case's tokens per sequence; seconds to the first token, total."""
    import numpy as np

    from llmopt.tools.bench import bench_prompts

    batch, prompt_len, new_tokens = case
    ids = np.asarray(bench_prompts(vocab_size, batch, prompt_len, seed), dtype=np.int32)
    params = og.GeneratorParams(model)
    length = prompt_len + new_tokens  # min_length = max_length: EOS is ignored
    params.set_search_options(do_sample=False, max_length=length, min_length=length,
                              batch_size=batch)
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(ids)
    generator.generate_next_token()
    first = time.perf_counter() - started
    for _ in range(new_tokens - 1):
        generator.generate_next_token()
    total = time.perf_counter() - started
    got = [len(generator.get_sequence(i)) for i in range(batch)]
    assert got == [length] * batch, got
    return first, total


# ---- what each system loads -----------------------------------------------------------


def prepare(systems: list[str], out_dir: Path, recipe: Path, recompile: bool = False
            ) -> dict[str, str]:
    """What each system's worker loads: artifact directory, GGUF file or GenAI model dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    targets: dict[str, str] = {}
    gguf_q4_1 = package_gguf(recipe)
    for system in systems:
        if system in ARTIFACTS:
            name, overrides = ARTIFACTS[system]
            targets[system] = str(compile_artifact(out_dir / name, recipe, overrides,
                                                   recompile))
        elif system in LLAMA_CPP:
            name = LLAMA_CPP[system]
            if name is None:
                targets[system] = str(gguf_q4_1)
            else:
                f32 = ensure_f32_gguf(gguf_q4_1, out_dir / "smollm2-f32.gguf")
                targets[system] = str(ensure_llama_quant(f32, out_dir / name))
        else:
            hf_dir = ensure_hf_dir(gguf_q4_1, out_dir / "smollm2-hf")
            targets[system] = str(ensure_ort_genai(hf_dir, out_dir / "ort-genai-int4"))
    return targets


# ---- driver: interleaved rounds, medians, ratios, table, JSON --------------------------


def worker_args(system: str, mode: str, threads: int, args: argparse.Namespace,
                target: str) -> list[str]:
    key = "artifact" if system in ARTIFACTS else "model"
    return [__file__, "--worker", f"system={system}", f"mode={mode}", f"threads={threads}",
            f"{key}={target}", "--batch", args.batch, "--contexts", args.contexts,
            "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--context-gen-len", str(args.context_gen_len),
            "--bandwidth-mib", str(args.bandwidth_mib),
            "--working-set-mib", str(args.working_set_mib)]


def run_rounds(args: argparse.Namespace, targets: dict[str, str]) -> list[dict[str, Any]]:
    """Every worker record, in the order run: round, threads, then the bandwidth probe and
    each system's batch and context workers back to back."""
    modes = [mode for mode, given in (("batch", args.batch), ("contexts", args.contexts))
             if parse_ints(given)]
    jobs = [(BANDWIDTH, "bandwidth", "")]
    jobs += [(system, mode, target) for system, target in targets.items() for mode in modes]
    records = []
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for threads in parse_ints(args.threads):
            for system, mode, target in jobs:
                load_before = list(os.getloadavg())
                trip_before = core_round_trip_ns() if threads > 1 else None
                record = run_json_worker(worker_args(system, mode, threads, args, target),
                                         thread_env(threads))
                record |= {"round": round_index, "loadavg_before": load_before,
                           "loadavg_after": list(os.getloadavg())}
                if trip_before is not None:  # how far apart the cores were (_core_latency)
                    record["core_round_trip_ns"] = [trip_before, core_round_trip_ns()]
                records.append(record)
                print(f"round {round_index + 1} {progress(record)}", flush=True)
        per_round = (time.perf_counter() - started) / (round_index + 1)
        print(f"round {round_index + 1}/{args.rounds} done; about "
              f"{per_round * (args.rounds - round_index - 1) / 60:.0f} min left", flush=True)
    return records


def progress(record: dict[str, Any]) -> str:
    head = f"{record['system']:<18} {record['mode']:<9} t={record['threads']}: "
    if record["mode"] == "bandwidth":
        probe = record["results"][0]
        body = (f"{probe['gb_s']:.1f} GB/s read, {probe['working_set_gb_s']:.1f} GB/s over "
                "the weights' size")
    else:
        label = "b" if record["mode"] == "batch" else "prompt "
        key = "batch" if record["mode"] == "batch" else "prompt_len"
        body = "decode tok/s/stream " + ", ".join(
            f"{label}{r[key]} {r['decode_tok_s_per_stream']:.1f}" for r in record["results"])
    trips = record.get("core_round_trip_ns")
    apart = (f", cores {number(trips[0])} / {number(trips[1])} ns apart" if trips else "")
    return (head + body + f" ({record['worker_s']:.0f} s, load "
            f"{record['loadavg_before'][0]:.2f} -> {record['loadavg_after'][0]:.2f}{apart})")


def summarize(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Median (and min/max) of each metric over rounds per (system, `key`, threads), and
    decode and aggregate vs each anchor at the same `key` and threads: the ratio of medians
    (the tables) and, for decode, the median of per-round ratios (JSON `decode_vs_paired`)."""
    rows = median_rows(records, METRICS, key=key)
    by_key = {(r["system"], r[key], r["threads"]): r for r in rows}
    decode = {(rec["round"], rec["system"], r[key], rec["threads"]):
              r["decode_tok_s_per_stream"] for rec in records for r in rec["results"]}
    for row in rows:
        row["decode_vs"], row["aggregate_vs"], row["decode_vs_paired"] = {}, {}, {}
        for anchor in ANCHORS:
            other = by_key.get((anchor, row[key], row["threads"]))
            if not other:
                continue
            for metric, field in (("decode_tok_s_per_stream", "decode_vs"),
                                  ("aggregate_tok_s", "aggregate_vs")):
                row[field][anchor] = row[metric] / other[metric]
            # Paired: the ratio within each round (systems run back to back), then the median.
            paired = [v / decode[(rnd, anchor, *rest[1:])] for (rnd, *rest), v in decode.items()
                      if tuple(rest) == (row["system"], row[key], row["threads"])
                      and (rnd, anchor, *rest[1:]) in decode]
            row["decode_vs_paired"][anchor] = statistics.median(paired)
        own_b1 = by_key.get((row["system"], 1, row["threads"]))
        if key == "batch" and own_b1:
            row["aggregate_vs_own_b1"] = row["aggregate_tok_s"] / own_b1["aggregate_tok_s"]
            # the decode phase's: every stream decoding, no prompt in the steps
            row["decode_aggregate_vs_own_b1"] = (row["decode_aggregate_tok_s"]
                                                 / own_b1["decode_aggregate_tok_s"])
            row["aggregate_vs_own_b1_by_round"] = rounds_vs_own_b1(records, row)
    return sorted(rows, key=lambda r: (r["threads"], r[key], SYSTEMS.index(r["system"])))


def rounds_vs_own_b1(records: list[dict[str, Any]], row: dict[str, Any]
                     ) -> list[dict[str, Any]]:
    """A batch row's aggregate and decode aggregate over its own batch 1's, round by round
    (both from one worker), with the cores' round trip before and after it (multi-thread
    workers)."""
    out = []
    for record in records:
        if (record["system"], record["threads"]) != (row["system"], row["threads"]):
            continue
        results = {r["batch"]: r for r in record["results"]}
        if row["batch"] in results and 1 in results:
            batch, single = results[row["batch"]], results[1]
            out.append({"round": record["round"],
                        "ratio": batch["aggregate_tok_s"] / single["aggregate_tok_s"],
                        "decode_ratio": (batch["decode_aggregate_tok_s"]
                                         / single["decode_aggregate_tok_s"]),
                        "core_round_trip_ns": record.get("core_round_trip_ns")})
    return out


# ---- the bandwidth bound: measured read bandwidth / bytes per decode token -------------


def system_bytes(system: str, target: str) -> dict[str, Any]:
    """Weight bytes one batch-1 decode token streams (by kind) and KV bytes per position."""
    path = Path(target)
    if system in ARTIFACTS:
        weights = onnx_weight_bytes(llmopt_model_file(path))
        kv = llmopt_kv_bytes_per_position(path)
    elif system in LLAMA_CPP:
        weights, kv = gguf_weight_bytes(path), gguf_kv_bytes_per_position(path)
    else:
        weights = onnx_weight_bytes(ort_genai_model_file(path))
        kv = ort_genai_kv_bytes_per_position(path)
    return {"weight_bytes": sum(weights.values()), "weight_bytes_by_kind": weights,
            "kv_bytes_per_position": kv}


def bandwidth_by_threads(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Median over rounds of each round's best read bandwidth, per thread count: over the
    DRAM probe's array (`gb_s`) and over the weights-sized one (`working_set_gb_s`)."""
    per: dict[int, dict[str, list[float]]] = {}
    dots: dict[int, list[float]] = {}
    for rec in records:
        if rec["mode"] == "bandwidth":
            probes = per.setdefault(rec["threads"], {"gb_s": [], "working_set_gb_s": []})
            for key, values in probes.items():
                values.append(rec["results"][0][key])
            if rec["results"][0].get("dot_g_macs"):
                dots.setdefault(rec["threads"], []).append(rec["results"][0]["dot_g_macs"])
    return {t: {key: statistics.median(v) for key, v in probes.items()}
            | {"range": [min(probes["gb_s"]), max(probes["gb_s"])],
               "working_set_range": [min(probes["working_set_gb_s"]),
                                     max(probes["working_set_gb_s"])],
               "dot_g_macs": statistics.median(dots[t]) if t in dots else None}
            for t, probes in per.items()}


def bound_rows(sizes: dict[str, dict[str, Any]], bandwidth: dict[int, dict[str, Any]],
               batch_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (system, threads): bound tok/s = working-set bandwidth / weight bytes per token
    (KV reads left out: see the contexts table; the DRAM-bandwidth bound beside it), and
    batch-1 decode at --prompt-len as a fraction of the bound."""
    decode = {(r["system"], r["threads"]): r["decode_tok_s_per_stream"]
              for r in batch_rows if r["batch"] == 1}
    rows = []
    for threads, bw in sorted(bandwidth.items()):
        for system, size in sizes.items():
            bound = bw["working_set_gb_s"] * 1e9 / size["weight_bytes"]
            measured = decode.get((system, threads))
            rows.append({"system": system, "threads": threads, "bandwidth_gb_s": bw["gb_s"],
                         "working_set_gb_s": bw["working_set_gb_s"],
                         "dram_bound_tok_s": bw["gb_s"] * 1e9 / size["weight_bytes"],
                         "weight_bytes": size["weight_bytes"],
                         "kv_bytes_per_position": size["kv_bytes_per_position"],
                         "bound_tok_s": bound, "decode_tok_s": measured,
                         "fraction_of_bound": measured / bound if measured else None})
    return rows


def add_context_bounds(rows: list[dict[str, Any]], sizes: dict[str, dict[str, Any]],
                       bandwidth: dict[int, dict[str, Any]], gen_len: int) -> None:
    """Each context row's bound with its KV reads: weights + KV bytes of the mean number of
    cached positions over the decode (prompt + gen / 2)."""
    for row in rows:
        bw, size = bandwidth.get(row["threads"]), sizes[row["system"]]
        positions = row["prompt_len"] + gen_len / 2
        step_bytes = size["weight_bytes"] + size["kv_bytes_per_position"] * positions
        row["bound_tok_s"] = bw["working_set_gb_s"] * 1e9 / step_bytes if bw else None
        row["fraction_of_bound"] = (row["decode_tok_s_per_stream"] / row["bound_tok_s"]
                                    if bw else None)


# ---- the arithmetic floor of a batched run: its int8 multiply-adds / the dot rate -------


def arithmetic_rows(batch_rows: list[dict[str, Any]], targets: dict[str, str],
                    bandwidth: dict[int, dict[str, Any]], prompt_len: int, gen_len: int
                    ) -> list[dict[str, Any]]:
    """Per native llmopt system, threads and batch: the run's multiply-adds, its floor at
    the measured dot rate (_arithmetic_bound.py), the measured run as a fraction of that
    floor, and the highest aggregate over the system's own measured batch 1 that the floor
    leaves (the batch-16 target asks 4x; batch 1 itself is bound by reading, not
    multiplying: the bound table)."""
    own_b1 = {(r["system"], r["threads"]): r["aggregate_tok_s"]
              for r in batch_rows if r["batch"] == 1}
    rows = []
    for r in batch_rows:
        plan = (native_plan(Path(targets[r["system"]]))
                if r["system"].endswith("-native") else None)
        rate = bandwidth.get(r["threads"], {}).get("dot_g_macs")
        if plan is None or not rate:
            continue
        macs = run_macs(plan, r["batch"], prompt_len, gen_len)
        floor_s = macs / (rate * 1e9)
        wall_s = r["batch"] * gen_len / r["aggregate_tok_s"]
        b1 = own_b1.get((r["system"], r["threads"]))
        rows.append({"system": r["system"], "threads": r["threads"], "batch": r["batch"],
                     "g_macs": macs / 1e9, "dot_g_macs_per_s": rate, "floor_s": floor_s,
                     "wall_s": wall_s, "fraction_of_rate": floor_s / wall_s,
                     "best_aggregate_vs_own_b1": (r["batch"] * gen_len / floor_s / b1
                                                  if b1 and r["batch"] > 1 else None)})
    return rows


# ---- acceptance: the targets, checked on the medians ---------------------------


def acceptance(batch_rows: list[dict[str, Any]], context_rows: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """Issue 14's targets for each llmopt int4 system and thread count (where measured)."""
    batch = {(r["system"], r["batch"], r["threads"]): r for r in batch_rows}
    contexts = sorted({r["prompt_len"] for r in context_rows})
    context = {(r["system"], r["prompt_len"], r["threads"]): r for r in context_rows}
    checks: list[dict[str, Any]] = []

    def check(target: str, threads: int, measured: float | None, goal: float) -> None:
        if measured is not None:
            checks.append({"target": target, "threads": threads, "measured": measured,
                           "goal": goal, "met": measured >= goal})

    for system in INT4_LLMOPT:
        for threads in sorted({r["threads"] for r in [*batch_rows, *context_rows]}):
            for prompt in contexts[:1] + contexts[1:][-1:]:  # the shortest and the longest
                row = context.get((system, prompt, threads), {})
                for anchor in (Q4_0, OG):
                    check(f"{system} batch-1 decode at context {prompt} vs {anchor}", threads,
                          row.get("decode_vs", {}).get(anchor), 1.0)
            row = batch.get((system, 8, threads), {})
            for anchor in (Q4_0, OG):
                check(f"{system} batch-8 aggregate vs {anchor}", threads,
                      row.get("aggregate_vs", {}).get(anchor), TARGET)
            b16 = batch.get((system, 16, threads), {})
            check(f"{system} batch-16 decode aggregate vs its batch 1", threads,
                  b16.get("decode_aggregate_vs_own_b1"), 4.0)
            check(f"{system} batch-16 aggregate (prompts included) vs its batch 1", threads,
                  b16.get("aggregate_vs_own_b1"), 4.0)
            if system in Q4_1_LLMOPT:
                check(f"{system} batch-1 decode vs {Q4_1}", threads,
                      batch.get((system, 1, threads), {}).get("decode_vs", {}).get(Q4_1), 1.0)
    return checks


# ---- tables ----------------------------------------------------------------------------


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def present_anchors(rows: list[dict[str, Any]]) -> list[str]:
    return [a for a in ANCHORS if any(a == r["system"] for r in rows)]


def decode_cell(r: dict[str, Any]) -> str:
    lo, hi = r["decode_tok_s_per_stream_range"]
    return f"{r['decode_tok_s_per_stream']:.1f} ({lo:.1f}-{hi:.1f})"


def batch_table(rows: list[dict[str, Any]]) -> str:
    anchors = present_anchors(rows)
    header = ["system", "threads", "batch", "prefill ms", "decode tok/s/stream (min-max)",
              "aggregate tok/s (decode phase)", "vs own b1 (decode phase)", "peak RSS MiB",
              *(f"vs {a} (decode / agg)" for a in anchors)]
    return markdown(header, [
        [r["system"], str(r["threads"]), str(r["batch"]), f"{r['prefill_ms']:.0f}",
         decode_cell(r), f"{r['aggregate_tok_s']:.1f} ({r['decode_aggregate_tok_s']:.1f})",
         f"{ratio(r.get('aggregate_vs_own_b1'))} ({ratio(r.get('decode_aggregate_vs_own_b1'))})",
         f"{r['peak_rss_mib']:.0f}",
         *(f"{ratio(r['decode_vs'].get(a))} / {ratio(r['aggregate_vs'].get(a))}"
           for a in anchors)] for r in rows])


def context_table(rows: list[dict[str, Any]]) -> str:
    anchors = present_anchors(rows)
    header = ["system", "threads", "prompt", "prefill ms", "decode tok/s (min-max)",
              "peak RSS MiB", "bound tok/s (weights + KV)", "of bound",
              *(f"vs {a}" for a in anchors)]
    return markdown(header, [
        [r["system"], str(r["threads"]), str(r["prompt_len"]), f"{r['prefill_ms']:.0f}",
         decode_cell(r), f"{r['peak_rss_mib']:.0f}", number(r["bound_tok_s"]),
         percent(r["fraction_of_bound"]), *(ratio(r["decode_vs"].get(a)) for a in anchors)]
        for r in rows])


def bound_table(rows: list[dict[str, Any]], prompt_len: int) -> str:
    header = ["system", "threads", "weights MB/token", "KV KiB/position",
              "read GB/s (DRAM / weights' size)", "bound tok/s (DRAM / weights' size)",
              f"batch-1 decode tok/s (prompt {prompt_len})", "of bound (weights' size)"]
    return markdown(header, [
        [r["system"], str(r["threads"]), f"{r['weight_bytes'] / 1e6:.1f}",
         f"{r['kv_bytes_per_position'] / 1024:.1f}",
         f"{r['bandwidth_gb_s']:.1f} / {r['working_set_gb_s']:.1f}",
         f"{r['dram_bound_tok_s']:.0f} / {r['bound_tok_s']:.0f}", number(r["decode_tok_s"]),
         percent(r["fraction_of_bound"])]
        for r in rows])


def arithmetic_table(rows: list[dict[str, Any]]) -> str:
    header = ["system", "threads", "batch", "G multiply-adds", "dot rate G/s",
              "floor s", "measured s", "of rate", "agg vs own b1 at the floor"]
    return markdown(header, [
        [r["system"], str(r["threads"]), str(r["batch"]), f"{r['g_macs']:.1f}",
         f"{r['dot_g_macs_per_s']:.0f}", f"{r['floor_s']:.3f}", f"{r['wall_s']:.3f}",
         percent(r["fraction_of_rate"]), ratio(r["best_aggregate_vs_own_b1"])]
        for r in rows])


def by_round_table(rows: list[dict[str, Any]]) -> str:
    cells = [[r["system"], str(r["threads"]), str(entry["round"] + 1),
              f"{entry['ratio']:.2f}x ({entry['decode_ratio']:.2f}x)",
              " / ".join(number(t) for t in entry["core_round_trip_ns"] or [None])]
             for r in rows if r["batch"] == 16 and r["threads"] > 1
             for entry in r.get("aggregate_vs_own_b1_by_round", [])]
    header = ["system", "threads", "round", "b16 / b1 aggregate (decode phase)",
              "cores apart, ns"]
    return markdown(header, cells) if cells else ""


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1", help="intra-op thread counts, comma-separated")
    p.add_argument("--batch", default="1,4,8,16",
                   help="batch sizes at --prompt-len, comma-separated ('' skips them)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--contexts", default="128,512,1024,1900",
                   help="batch-1 prompt lengths, comma-separated ('' skips them)")
    p.add_argument("--context-gen-len", type=int, default=64)
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="size of the array the DRAM read-bandwidth probe sums")
    p.add_argument("--working-set-mib", type=int, default=None,
                   help="size of the array the working-set probe sums (default: the median "
                        "of the chosen systems' weight bytes per token)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"subset of {SYSTEMS}, or 'all'")
    p.add_argument("--out-dir", type=Path, default=Path("out/int4-bench"),
                   help="artifacts and competitor models (built when missing)")
    p.add_argument("--recipe", type=Path, default=Path(DEFAULT_RECIPE))
    p.add_argument("--recompile", action="store_true",
                   help="compile the chosen llmopt artifacts afresh (after compiler or "
                        "runtime changes; competitor models are kept)")
    p.add_argument("--json", type=Path, default=None,
                   help="default benchmarks/results/bench_int4.json (bench_int4_profile.json "
                        "with --profile)")
    p.add_argument("--profile", metavar="SYSTEM", choices=[*ARTIFACTS, OG],
                   help="instead of the benchmark: ORT-profile this system's batch-1 decode "
                        "(an llmopt system or ort-genai-int4; first --threads value)")
    p.add_argument("--worker", nargs="+", metavar="KEY=VALUE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.json is None:
        name = f"bench_int4_profile_{args.profile}.json" if args.profile else "bench_int4.json"
        args.json = RESULTS_DIR / name
    return args


def chosen_systems(text: str) -> list[str]:
    systems = list(SYSTEMS) if text == "all" else [s.strip() for s in text.split(",")
                                                      if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        sys.exit(f"unknown systems {unknown}; choose from {list(SYSTEMS)} or 'all'")
    return systems


def check_lengths(args: argparse.Namespace, targets: dict[str, str]) -> None:
    """Prompt + generation must fit every llmopt artifact's context (checked before any run)."""
    longest = max([args.prompt_len + args.gen_len if parse_ints(args.batch) else 0,
                   *(c + args.context_gen_len for c in parse_ints(args.contexts))])
    for system, target in targets.items():
        if system in ARTIFACTS:
            limit = json.loads((Path(target) / "manifest.json").read_text()
                               )["model"]["max_position"]
            if longest + 1 > limit:
                sys.exit(f"{system}: prompt + generation ({longest}) + 1 exceeds the "
                         f"artifact's max context {limit}")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", LLAMA_CPP_LIB_DIR)  # workers inherit it
    args = parse_args()
    if args.worker:
        worker_main(dict(item.split("=", 1) for item in args.worker), args)
        return
    recipe, out_dir = REPO_ROOT / args.recipe, REPO_ROOT / args.out_dir
    if args.profile:
        targets = prepare([args.profile], out_dir, recipe, args.recompile)
        profile_main(args, args.profile, targets[args.profile],
                     llmopt=args.profile in ARTIFACTS)
        return
    systems = chosen_systems(args.systems)
    targets = prepare(systems, out_dir, recipe, args.recompile)
    check_lengths(args, targets)
    sizes = {system: system_bytes(system, target) for system, target in targets.items()}
    if args.working_set_mib is None:
        args.working_set_mib = math.ceil(statistics.median(
            size["weight_bytes"] for size in sizes.values()) / 2**20)
    machine = machine_info(("llama_cpp_python", "onnxruntime-genai", "gguf"))
    machine["uptime_at_start"] = uptime()
    print(f"uptime at start: {machine['uptime_at_start']}", flush=True)
    started = time.perf_counter()
    records = run_rounds(args, targets)
    machine["uptime_at_end"], machine["loadavg_at_end"] = uptime(), list(os.getloadavg())
    report = build_report(args, records, sizes, targets)
    print_report(args, machine, report)
    write_json(args.json, {
        "benchmark": "bench_int4", "machine": machine,
        "config": {"rounds": args.rounds, "threads": parse_ints(args.threads),
                   "batch": parse_ints(args.batch), "prompt_len": args.prompt_len,
                   "gen_len": args.gen_len, "contexts": parse_ints(args.contexts),
                   "context_gen_len": args.context_gen_len,
                   "bandwidth_mib": args.bandwidth_mib,
                   "working_set_mib": args.working_set_mib, "systems": targets},
        "bytes_per_token": sizes, **report, "runs": records,
        "total_s": time.perf_counter() - started,
    })
    print(f"\nwrote {args.json}")


def build_report(args: argparse.Namespace, records: list[dict[str, Any]],
                 sizes: dict[str, dict[str, Any]], targets: dict[str, str]) -> dict[str, Any]:
    """Medians, ratios, bounds and the acceptance checks of every worker record."""
    bandwidth = bandwidth_by_threads(records)
    batch_rows = summarize([r for r in records if r["mode"] == "batch"], "batch")
    context_rows = summarize([r for r in records if r["mode"] == "contexts"], "prompt_len")
    add_context_bounds(context_rows, sizes, bandwidth, args.context_gen_len)
    return {"bandwidth_gb_s": bandwidth, "batch_summary": batch_rows,
            "context_summary": context_rows,
            "bound": bound_rows(sizes, bandwidth, batch_rows),
            "arithmetic": arithmetic_rows(batch_rows, targets, bandwidth, args.prompt_len,
                                          args.gen_len),
            "targets": acceptance(batch_rows, context_rows)}


def print_report(args: argparse.Namespace, machine: dict[str, Any],
                 report: dict[str, Any]) -> None:
    print(f"\nmedians of {args.rounds} interleaved rounds; {machine['cpu_model']}, nproc "
          f"{machine['nproc']}\nuptime at start: {machine['uptime_at_start']}\n"
          f"uptime at end:   {machine['uptime_at_end']}")
    if report["batch_summary"]:
        print(f"\nbatch scaling (prompt {args.prompt_len}, gen {args.gen_len}; ratios are "
              "decode tok/s/stream / aggregate tok/s of the row over the anchor's)\n")
        print(batch_table(report["batch_summary"]))
    if report["context_summary"]:
        print(f"\ncontext scaling (batch 1, gen {args.context_gen_len}; the bound counts the "
              "weights and the KV cache read at prompt + gen/2 cached positions)\n")
        print(context_table(report["context_summary"]))
    print("\nbatch-1 bandwidth bound (weights only; read GB/s: median over rounds of the best "
          f"of {BANDWIDTH_REPEATS} reads of {args.bandwidth_mib} MiB / of "
          f"{4 * BANDWIDTH_REPEATS} of {args.working_set_mib} MiB, the weights' size, by numpy "
          "or the native read loop)\n")
    print(bound_table(report["bound"], args.prompt_len))
    if report["arithmetic"]:
        print("\nbatched runs against the int8 dot rate (native artifacts: the run's "
              "multiply-adds / probe_dot_rate.c's zmm rate, one probe per thread at once; the "
              "last column: the aggregate the floor would give over the measured batch 1's)\n")
        print(arithmetic_table(report["arithmetic"]))
    rounds = by_round_table(report["batch_summary"])
    if rounds:
        print("\nbatch 16 over its own batch 1, round by round at 2+ threads (one worker each), "
              "with how far apart the cores were before / after it (probe_core_latency.c)\n")
        print(rounds)
    print()
    for check in report["targets"]:
        print(f"{check['target']} >= {check['goal']}x at {check['threads']} thread(s): "
              f"{check['measured']:.2f}x -> {'met' if check['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
