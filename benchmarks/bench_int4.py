"""llmopt int4 artifacts against llama.cpp and ONNX Runtime GenAI int4 on SmolLM2-135M-Instruct.

    python benchmarks/bench_int4.py --rounds 3

Systems (each worker a fresh subprocess, greedy, EOS ignored, same random prompts):
  llmopt-fp32          recipes/smollm2-135m-instruct.yaml as is (the same-run baseline)
  llmopt-q4_1          gguf_weights: the file's own Q4_1 blocks, float LM head, accuracy level 0
  llmopt-q4_1-a8       gguf_weights + the file's Q8_0 LM head, accuracy level 4 (int8 activations)
  llmopt-rtn4-a8       rtn int4 sym g32 decoder linears + the file's Q8_0 LM head, level 4
  llmopt-rtn4-a8-dq    the same weights lowered as DequantizeLinear -> MatMul (ORT fuses them)
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
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    RESULTS_DIR,
    compile_artifact,
    machine_info,
    median_rows,
    run_json_worker,
    save_plain_hf,
    thread_env,
    write_json,
)
from bench_foundation import (
    WARMUP_GEN_LEN,
    parse_ints,
    peak_rss_mib,
    prompt_seed,
    ratio,
    recipe_model,
    run_llmopt,
)

DEFAULT_RECIPE = "recipes/smollm2-135m-instruct.yaml"
Q8_HEAD = "{gguf_weights: {include_lm_head: true, skip: ['layers.*']}}"
# llmopt system -> (artifact directory name under --out-dir, recipe overrides)
ARTIFACTS: dict[str, tuple[str, list[str]]] = {
    "llmopt-fp32": ("smollm2", []),
    "llmopt-q4_1": ("smollm2-gguf-q4_1", ["passes=[{gguf_weights: {include_lm_head: false}}]"]),
    "llmopt-q4_1-a8": ("smollm2-gguf-q4_1-q8head-a8",
                       ["passes=[{gguf_weights: {include_lm_head: true}}]",
                        "target.nbits_accuracy_level=4"]),
    "llmopt-rtn4-a8": ("smollm2-rtn4-sym-g32-q8head-a8",
                       ["passes=[{rtn: {bits: 4, group_size: 32, symmetric: true}}, "
                        f"{Q8_HEAD}]", "target.nbits_accuracy_level=4"]),
    "llmopt-rtn4-a8-dq": ("smollm2-rtn4-sym-g32-q8head-a8-dq",
                          ["passes=[{rtn: {bits: 4, group_size: 32, symmetric: true}}, "
                           f"{Q8_HEAD}]", "target.nbits_accuracy_level=4",
                           "target.quantized_matmul=dequantize_linear"]),
}
# llama.cpp system -> GGUF file name under --out-dir (Q4_1: the package's own file)
LLAMA_CPP = {"llama.cpp-q4_1": None, "llama.cpp-q4_0": "smollm2-q4_0.gguf",
             "llama.cpp-q8_0": "smollm2-q8_0.gguf"}
LLAMA_FTYPES = {"smollm2-q4_0.gguf": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "smollm2-q8_0.gguf": "LLAMA_FTYPE_MOSTLY_Q8_0"}
OG = "ort-genai-int4"
SYSTEMS = (*ARTIFACTS, *LLAMA_CPP, OG)
INT4_LLMOPT = ("llmopt-q4_1", "llmopt-q4_1-a8", "llmopt-rtn4-a8", "llmopt-rtn4-a8-dq")
ANCHORS = ("llama.cpp-q4_1", "llama.cpp-q4_0", "llama.cpp-q8_0", OG)
LLAMA_4BIT = ("llama.cpp-q4_1", "llama.cpp-q4_0")
TARGET = 1.2
METRICS = ("prefill_ms", "decode_tok_s_per_stream", "aggregate_tok_s", "peak_rss_mib")


# ---- workers: one system, every batch size, one JSON line ------------------------------


def worker_main(spec: dict[str, str], args: argparse.Namespace) -> None:
    threads, batches = int(spec["threads"]), parse_ints(args.batch)
    system = spec["system"]
    run = (run_llmopt if system in ARTIFACTS else run_llama_cpp if system in LLAMA_CPP
           else run_ort_genai)
    started = time.perf_counter()
    results = run(spec, threads, batches, args.prompt_len, args.gen_len)
    print(json.dumps({"system": system, "threads": threads, "results": results,
                      "worker_s": time.perf_counter() - started}), flush=True)


def timed_result(batch: int, gen_len: int, prefill_s: float, total_s: float) -> dict[str, float]:
    """The metrics of one greedy generation timed as: prefill (to the first token), total."""
    return {"batch": batch, "prefill_ms": 1000 * prefill_s,
            "decode_tok_s_per_stream": (gen_len - 1) / (total_s - prefill_s),
            "aggregate_tok_s": batch * gen_len / total_s, "wall_s": total_s,
            "peak_rss_mib": peak_rss_mib()}


def run_llama_cpp(
    spec: dict[str, str], threads: int, batches: list[int], prompt_len: int, gen_len: int
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
    for batch in batches:  # ascending, so ru_maxrss after each batch is that batch's peak
        ctx = LlamaCppBatch(lc, model, n_vocab, batch, prompt_len + gen_len, threads)
        ctx.generate(prompt_len, WARMUP_GEN_LEN, prompt_seed(batch, True))
        prefill_s, total_s = ctx.generate(prompt_len, gen_len, prompt_seed(batch, False))
        results.append(timed_result(batch, gen_len, prefill_s, total_s))
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

        from llmopt.runtime.bench import bench_prompts

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


def run_ort_genai(
    spec: dict[str, str], threads: int, batches: list[int], prompt_len: int, gen_len: int
) -> list[dict[str, float]]:
    import numpy as np
    import onnxruntime_genai as og

    from llmopt.runtime.bench import bench_prompts

    config = og.Config(spec["model"])
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    vocab_size = json.loads((Path(spec["model"]) / "genai_config.json").read_text()
                            )["model"]["vocab_size"]

    def generate(batch: int, new_tokens: int, seed: int) -> tuple[float, float]:
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

    results = []
    for batch in batches:
        generate(batch, WARMUP_GEN_LEN, prompt_seed(batch, True))
        prefill_s, total_s = generate(batch, gen_len, prompt_seed(batch, False))
        results.append(timed_result(batch, gen_len, prefill_s, total_s))
    return results


# ---- competitor models: HF dir, ORT GenAI int4, llama.cpp Q4_0 / Q8_0 ------------------


def package_gguf(recipe: Path) -> Path:
    from llmopt.compiler.loader import resolve_checkpoint

    ref = resolve_checkpoint(recipe_model(recipe))
    if not ref.gguf_file:
        sys.exit(f"{recipe}: the recipe's model is not a GGUF file")
    return Path(ref.location) / ref.gguf_file


def ensure_hf_dir(gguf_path: Path, out: Path) -> Path:
    """The GGUF dequantized by transformers to fp32, saved as a Hugging Face directory."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"writing {out} ...", flush=True)
    kwargs = {"gguf_file": gguf_path.name}
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                  **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    tmp = out.with_name(out.name + ".tmp")
    save_plain_hf(loaded, tokenizer, tmp)
    tmp.rename(out)
    return out


def ensure_ort_genai(hf_dir: Path, out: Path) -> Path:
    """onnxruntime-genai's model builder, int4 for the CPU (its defaults: RTN symmetric,
    block 32, every MatMul including the LM head, accuracy level 4)."""
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
           "-o", str(tmp), "-p", "int4", "-e", "cpu", "-c", str(out.parent / "og-cache")]
    run_logged(cmd, out.parent / "ort-genai-build.log")
    tmp.rename(out)
    return out


def ensure_f32_gguf(source: Path, out: Path) -> Path:
    """`source` with every tensor dequantized to F32 (same names, layout and metadata), for
    llama.cpp's quantizer: llama-cpp-python ships no HF -> GGUF converter."""
    if out.is_file():
        return out
    import gguf
    import numpy as np

    print(f"writing {out} ...", flush=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def ensure_llama_quant(f32_gguf: Path, out: Path) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, default params) on the F32 GGUF."""
    if out.is_file():
        return out
    import llama_cpp as lc

    print(f"quantizing {out} ...", flush=True)
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, LLAMA_FTYPES[out.name])
    tmp = out.with_name(out.name + ".tmp")
    if lc.llama_model_quantize(str(f32_gguf).encode(), str(tmp).encode(), params) != 0:
        sys.exit(f"llama_model_quantize failed for {out}")
    tmp.rename(out)
    return out


def run_logged(cmd: list[str], log: Path) -> None:
    print(f"running {' '.join(cmd)} (log: {log}) ...", flush=True)
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{cmd[:4]} failed; see {log}")
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


def prepare(systems: list[str], out_dir: Path, recipe: Path) -> dict[str, str]:
    """What each system's worker loads: artifact directory, GGUF file or GenAI model dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    targets: dict[str, str] = {}
    gguf_q4_1 = package_gguf(recipe)
    for system in systems:
        if system in ARTIFACTS:
            name, overrides = ARTIFACTS[system]
            targets[system] = str(compile_artifact(out_dir / name, recipe, overrides))
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


def worker_args(system: str, threads: int, args: argparse.Namespace, target: str) -> list[str]:
    key = "artifact" if system in ARTIFACTS else "model"
    return [__file__, "--worker", f"system={system}", f"threads={threads}", f"{key}={target}",
            "--batch", args.batch, "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len)]


def run_rounds(args: argparse.Namespace, targets: dict[str, str]) -> list[dict[str, Any]]:
    records = []
    for round_index in range(args.rounds):
        for threads in parse_ints(args.threads):
            for system in targets:
                load_before = list(os.getloadavg())
                record = run_json_worker(worker_args(system, threads, args, targets[system]),
                                         thread_env(threads))
                record |= {"round": round_index, "loadavg_before": load_before,
                           "loadavg_after": list(os.getloadavg())}
                records.append(record)
                parts = [f"b{r['batch']} {r['decode_tok_s_per_stream']:.1f}"
                         for r in record["results"]]
                print(f"round {round_index + 1} {system:<16} t={threads}: decode tok/s/stream "
                      + ", ".join(parts) + f" ({record['worker_s']:.0f} s, load "
                      f"{load_before[0]:.2f} -> {record['loadavg_after'][0]:.2f})", flush=True)
    return records


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median (and min/max) of each metric over rounds per (system, batch, threads), and
    decode vs each anchor at the same batch and threads: the ratio of medians (the table)
    and the median of the per-round ratios (JSON `decode_vs_paired`)."""
    rows = median_rows(records, METRICS)
    by_key = {(r["system"], r["batch"], r["threads"]): r for r in rows}
    # Paired: the ratio within each round (systems run back to back), then the median.
    decode = {(rec["round"], rec["system"], r["batch"], rec["threads"]):
              r["decode_tok_s_per_stream"] for rec in records for r in rec["results"]}
    for row in rows:
        row["decode_vs"], row["decode_vs_paired"] = {}, {}
        for anchor in ANCHORS:
            other = by_key.get((anchor, row["batch"], row["threads"]))
            if other:
                row["decode_vs"][anchor] = (row["decode_tok_s_per_stream"]
                                            / other["decode_tok_s_per_stream"])
                key = (row["system"], row["batch"], row["threads"])
                paired = [v / decode[(rnd, anchor, *key[1:])]
                          for (rnd, *rest), v in decode.items()
                          if tuple(rest) == key and (rnd, anchor, *key[1:]) in decode]
                row["decode_vs_paired"][anchor] = statistics.median(paired)
    return sorted(rows, key=lambda r: (r["threads"], r["batch"], SYSTEMS.index(r["system"])))


def targets_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Batch-1 decode of each llmopt int4 system >= 1.2x llama.cpp (its faster 4-bit file)
    and >= 1.2x ORT GenAI int4."""
    checks = []
    for row in rows:
        if row["system"] not in INT4_LLMOPT or row["batch"] != 1:
            continue
        llama = [(row["decode_vs"][a], a) for a in LLAMA_4BIT if a in row["decode_vs"]]
        for name, pair in (("llama.cpp", min(llama) if llama else None),
                           ("ORT GenAI int4", (row["decode_vs"].get(OG), OG))):
            if pair is None or pair[0] is None:
                continue
            checks.append({"target": f"{row['system']} batch-1 decode >= {TARGET}x {name}",
                           "threads": row["threads"], "against": pair[1],
                           "measured": pair[0], "paired": row["decode_vs_paired"][pair[1]],
                           "met": pair[0] >= TARGET})
    return checks


def format_table(rows: list[dict[str, Any]]) -> str:
    anchors = [a for a in ANCHORS if any(a == r["system"] for r in rows)]
    header = ("| system | batch | threads | prefill ms | decode tok/s/stream (min-max) "
              "| aggregate tok/s | peak RSS MiB | " + " | ".join(f"vs {a}" for a in anchors)
              + " |")
    lines = [header, "|" + "---|" * (header.count(" | ") + 1)]
    for r in rows:
        lo, hi = r["decode_tok_s_per_stream_range"]
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['threads']} | {r['prefill_ms']:.0f} "
            f"| {r['decode_tok_s_per_stream']:.1f} ({lo:.1f}-{hi:.1f}) "
            f"| {r['aggregate_tok_s']:.1f} | {r['peak_rss_mib']:.0f} | "
            + " | ".join(ratio(r["decode_vs"].get(a)) for a in anchors) + " |")
    return "\n".join(lines)


# ---- profile: where a system's batch-1 decode step spends its time ---------------------


def profile_main(args: argparse.Namespace, system: str, target: str) -> None:
    """Batch-1 generation with ONNX Runtime's profiler on (an llmopt artifact or the ORT
    GenAI model): per decode step, wall time vs session run vs kernel time, and kernel time
    per operator type and per node."""
    threads = parse_ints(args.threads)[0]
    prefix = str(Path(args.json).with_suffix("")) + f"-{system}"
    if system in ARTIFACTS:
        trace, step_s, decode_tok_s = profile_llmopt(target, threads, prefix, args)
    else:
        trace, step_s, decode_tok_s = profile_ort_genai(target, threads, prefix, args)
    events = json.loads(Path(trace).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    decode_runs = runs[-(args.gen_len - 1):]  # the timed generation's decode runs
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
    report = {
        "system": system, "target": target, "threads": threads, "decode_steps": n,
        "decode_tok_s": decode_tok_s, "step_wall_ms": 1000 * statistics.median(step_s),
        "model_run_ms": statistics.median(r["dur"] for r in decode_runs) / 1000,
        "kernel_ms": sum(per_op.values()) / n / 1000,
        "per_op_ms": {op: t / n / 1000 for op, t in sorted(per_op.items(), key=lambda x: -x[1])},
        "top_nodes_ms": {name: t / n / 1000 for name, t in
                         sorted(per_node.items(), key=lambda x: -x[1])[:30]},
        "trace": trace, "loadavg": list(os.getloadavg()),
    }
    print(f"{system}: decode {decode_tok_s:.1f} tok/s; median decode step "
          f"{report['step_wall_ms']:.2f} ms wall = {report['model_run_ms']:.2f} ms session run "
          f"({report['kernel_ms']:.2f} ms mean in kernels) + "
          f"{report['step_wall_ms'] - report['model_run_ms']:.2f} ms outside the graph; "
          f"load {report['loadavg'][0]:.2f}")
    for op, ms in report["per_op_ms"].items():
        print(f"  {op:<36} {ms:7.3f} ms/step")
    write_json(Path(args.json), report)
    print(f"wrote {args.json}")


def profile_llmopt(artifact: str, threads: int, prefix: str,
                   args: argparse.Namespace) -> tuple[str, list[float], float]:
    import llmopt.runtime.executor as executor
    from llmopt.runtime import LLM
    from llmopt.runtime.bench import run_bench

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

    from llmopt.runtime.bench import bench_prompts

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1", help="intra-op thread counts, comma-separated")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {SYSTEMS}")
    p.add_argument("--out-dir", type=Path, default=Path("out/int4-bench"),
                   help="artifacts and competitor models (built when missing)")
    p.add_argument("--recipe", type=Path, default=Path(DEFAULT_RECIPE))
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


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(dict(item.split("=", 1) for item in args.worker), args)
        return
    recipe, out_dir = REPO_ROOT / args.recipe, REPO_ROOT / args.out_dir
    if args.profile:
        targets = prepare([args.profile], out_dir, recipe)
        profile_main(args, args.profile, targets[args.profile])
        return
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        sys.exit(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    machine = machine_info(("llama_cpp_python", "onnxruntime-genai", "gguf"))
    targets = prepare(systems, out_dir, recipe)
    started = time.perf_counter()
    records = run_rounds(args, targets)
    rows = summarize(records)
    checks = targets_check(rows)
    machine["loadavg_at_end"] = list(os.getloadavg())
    print(f"\nmedians of {args.rounds} interleaved rounds; prompt {args.prompt_len}, "
          f"gen {args.gen_len}; {machine['cpu_model']}, nproc {machine['nproc']}; load average "
          f"{machine['loadavg_at_start'][0]:.2f} at start, {machine['loadavg_at_end'][0]:.2f} "
          "at end\n")
    print(format_table(rows))
    for check in checks:
        print(f"{check['target']} at {check['threads']} thread(s): {check['measured']:.2f}x "
              f"(vs {check['against']}; per-round median {check['paired']:.2f}x) -> "
              f"{'met' if check['met'] else 'NOT met'}")
    write_json(args.json, {
        "benchmark": "bench_int4", "machine": machine,
        "config": {"rounds": args.rounds, "threads": parse_ints(args.threads),
                   "batch": parse_ints(args.batch), "prompt_len": args.prompt_len,
                   "gen_len": args.gen_len, "systems": targets},
        "summary": rows, "targets": checks, "runs": records,
        "total_s": time.perf_counter() - started,
    })
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
