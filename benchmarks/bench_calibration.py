"""Sequential calibration at real sizes: wall time, per-layer rate and peak RSS of one
calibrating pass (gptq, awq, or kv_cache static scales) on a checkpoint, against
`memory_estimate.calibration_bytes`'s estimate of what the pass adds (peak minus the RSS before it).

Table columns: checkpoint | pass and `calibration.precision` | calibration | layers
run/depth | s per layer (median of the pass's own per-layer lines) | projected s for the
whole depth (per-layer rate x depth, plus what runs once: windows, the LM head) | peak RSS |
RSS before the pass | estimate.

    python benchmarks/bench_calibration.py CKPT --pass gptq --samples 128 --seq-len 512 \\
        --text /work/shared/data/wikitext2-test.raw.txt [--layers N] [--json out.json]

`--layers N` calibrates only the first N decoder layers (the peak is per layer, so it is
the full calibration's; calibration windows are taken as the whole model would take them).
Run one measurement per process (peak RSS is the process's); `/usr/bin/time -v` around it
gives the same peak from outside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info  # noqa: E402

from llmopt.compiler.checkpoint_ref import resolve_checkpoint  # noqa: E402
from llmopt.compiler.loader import load_checkpoint  # noqa: E402
from llmopt.compiler.memory_estimate import calibration_bytes, read_shape  # noqa: E402
from llmopt.compiler.pass_manager import PassContext, apply_passes  # noqa: E402
from llmopt.compiler.recipe import Recipe  # noqa: E402
from llmopt.compiler.sample_budget import can_sample, parameter_count  # noqa: E402

LAYER_LINE = re.compile(r"layer \d+/\d+.*?([\d.]+) s\)?$")  # gptq's and awq's per-layer lines

PASS_OPTIONS = {
    "gptq": {"bits": 4, "group_size": 128},
    "awq": {"bits": 4, "group_size": 128},
    "kv_cache": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel"},
}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gib() -> float:
    """The resident set now (the peak before the pass is the loader's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--pass", dest="name", choices=sorted(PASS_OPTIONS), default="gptq")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--text", required=True)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="calibration.precision: the calibration forward's linears")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    ir = load_checkpoint(args.checkpoint)
    depth, full_parameters = ir.arch.num_layers, parameter_count(ir.arch)
    loaded = time.perf_counter() - started
    if args.layers is not None:
        ir.arch = dataclasses.replace(ir.arch, layers=ir.arch.layers[:args.layers])
    options = dict(PASS_OPTIONS[args.name])
    if args.name == "kv_cache":
        options["calibration_samples"] = args.samples
    # Windows as the whole model takes them: cutting layers must not make it small enough
    # to sample (its samples would then count in the per-layer rate).
    samples_share = "auto" if can_sample(full_parameters) else 0
    recipe = Recipe(model=args.checkpoint, passes=[{args.name: options}],
                    calibration={"text": args.text, "samples": args.samples,
                                 "seq_len": args.seq_len, "model_samples": samples_share,
                                 "precision": args.precision},
                    quality={"measure": False})
    layer_lines: list[tuple[float, str]] = []

    def log(line: str) -> None:
        layer_lines.append((time.perf_counter(), line.strip()))
        print(line, flush=True)

    before = rss_gib()
    pass_started = time.perf_counter()
    apply_passes(ir, recipe.passes, PassContext(recipe, log))
    seconds = time.perf_counter() - pass_started
    layers = len(ir.arch.layers)
    layer_s = [float(m.group(1)) for _, line in layer_lines
               if (m := LAYER_LINE.search(line))] or [seconds / max(1, layers)] * layers
    rest_s = seconds - sum(layer_s)  # windows, the LM head: once per compile, not per layer
    shape = read_shape(resolve_checkpoint(args.checkpoint))
    estimate = calibration_bytes(shape, args.samples, args.seq_len, args.name)
    result = {
        "checkpoint": args.checkpoint, "pass": args.name, "samples": args.samples,
        "seq_len": args.seq_len, "precision": args.precision, "layers_calibrated": layers,
        "depth": depth,
        "load_s": round(loaded, 1), "pass_s": round(seconds, 1),
        "s_per_layer": round(statistics.median(layer_s), 1) if layer_s else None,
        "once_s": round(rest_s, 1),
        "projected_full_s": (round(rest_s + statistics.median(layer_s) * depth)
                             if layer_s else None),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "rss_before_pass_gib": round(before, 2),
        "estimate_gib": round(estimate / 2**30, 2),
        "machine": machine_info(),
    }
    print(f"| {Path(args.checkpoint).name} | {args.name} {args.precision} | "
          f"{args.samples} x {args.seq_len} | "
          f"{layers}/{depth} | {result['s_per_layer']} s | {result['projected_full_s']} s | "
          f"{result['peak_rss_gib']} GiB | {result['rss_before_pass_gib']} GiB | "
          f"{result['estimate_gib']} GiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
