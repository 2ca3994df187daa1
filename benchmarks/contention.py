"""Decode speed on a busy machine: an artifact's default threads against `--threads 1`, with
0, 1 or 2 cores taken by CPU-bound neighbours, on the native step and ONNX Runtime.

A server shares its machine: a neighbour that wakes should cost it about its share of the
cores, not a collapse. Each case runs `llmopt bench --json` in a fresh process while the
neighbours (`python -c 'while True: pass'`) spin; cases are interleaved round by round.

    python benchmarks/contention.py ARTIFACT [--batch 1,8] [--rounds 3]
        [--variants 'ours=,spin=OMP_WAIT_POLICY=active'] [--kernels native,onnxruntime]

`--variants` names environment settings to compare (NAME=VAR=VALUE;VAR=VALUE), e.g. the
OpenMP wait policy the runtime chose against always spinning. Prints a table and writes
JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager
from itertools import product
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, machine_info, write_json

BUSY_LOOP = "while True: pass"
CLI = [sys.executable, "-c", "from llmopt.cli import main; main()"]


@contextmanager
def neighbours(count: int):
    """`count` CPU-bound processes for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def bench_once(artifact: Path, kernels: str, threads: int | None, batches: list[int],
               args: argparse.Namespace, env: dict[str, str]) -> dict[int, float]:
    """Decode-phase aggregate tok/s per batch size from one `llmopt bench --json` process."""
    command = [*CLI, "bench", str(artifact), "--json", "--kernels", kernels,
               "--batch", ",".join(map(str, batches)), "--prompt-len", str(args.prompt_len),
               "--gen-len", str(args.gen_len)]
    if threads is not None:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env},
                          timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"bench failed: {done.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["batch"]: row["decode_aggregate_tok_s"] for row in rows}


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    """'ours=,spin=OMP_WAIT_POLICY=active' -> {'ours': {}, 'spin': {...}}."""
    variants = {}
    for item in filter(None, text.split(",")):
        name, _, settings = item.partition("=")
        variants[name] = dict(s.split("=", 1) for s in filter(None, settings.split(";")))
    return variants


def run_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    variants = parse_variants(args.variants)
    cases = list(product(args.kernels.split(","), variants, (0, 1, 2), (None, 1)))
    records = []
    for round_index in range(args.rounds):
        for kernels, variant, busy, threads in cases:
            with neighbours(busy):
                speeds = bench_once(args.artifact, kernels, threads, args.batch, args,
                                    variants[variant])
            for batch, tok_s in speeds.items():
                records.append({"round": round_index, "kernels": kernels, "variant": variant,
                                "busy_cores": busy, "threads": threads or "default",
                                "batch": batch, "decode_tok_s": tok_s,
                                "loadavg": os.getloadavg()[0]})
            print(f"round {round_index} {kernels:11s} {variant:6s} busy {busy} threads "
                  f"{threads or 'default':7} {speeds}", file=sys.stderr, flush=True)
    return records


def medians(records: list[dict[str, Any]]) -> dict[tuple, float]:
    groups: dict[tuple, list[float]] = {}
    for r in records:
        key = (r["kernels"], r["variant"], r["batch"], r["busy_cores"], r["threads"])
        groups.setdefault(key, []).append(r["decode_tok_s"])
    return {key: statistics.median(values) for key, values in groups.items()}


def table_row(table: dict[tuple, float], kernels: str, variant: str, batch: int
              ) -> dict[str, Any]:
    """Speeds at every (busy cores, threads) and the issue's three ratios."""
    speed = {(busy, threads): table[(kernels, variant, batch, busy, threads)]
             for busy in (0, 1, 2) for threads in ("default", 1)}
    return {"kernels": kernels, "variant": variant, "batch": batch,
            "one_busy_default_over_1thread": speed[1, "default"] / speed[1, 1],
            "one_busy_default_over_quiet_default": speed[1, "default"] / speed[0, "default"],
            "both_busy_default_over_quiet_1thread": speed[2, "default"] / speed[0, 1],
            **{f"busy{b}_threads_{t}": v for (b, t), v in speed.items()}}


def print_table(table: dict[tuple, float]) -> list[dict[str, Any]]:
    """One row per kernels/variant/batch: decode tok/s and the ratios."""
    rows = [table_row(table, *key) for key in sorted({k[:3] for k in table})]
    print("decode-phase aggregate tok/s; busy = cores taken by neighbours; default = the "
          "artifact's default threads")
    print(f"{'kernels':11s} {'variant':8s} {'batch':>5s} {'quiet dflt':>10s} {'quiet 1':>8s} "
          f"{'1busy dflt':>10s} {'1busy 1':>8s} {'2busy dflt':>10s} | {'1busy d/1':>9s} "
          f"{'1busy d/quiet d':>15s} {'2busy d/quiet 1':>15s}")
    for r in rows:
        print(f"{r['kernels']:11s} {r['variant']:8s} {r['batch']:5d} "
              f"{r['busy0_threads_default']:10.1f} {r['busy0_threads_1']:8.1f} "
              f"{r['busy1_threads_default']:10.1f} {r['busy1_threads_1']:8.1f} "
              f"{r['busy2_threads_default']:10.1f} | {r['one_busy_default_over_1thread']:9.2f} "
              f"{r['one_busy_default_over_quiet_default']:15.2f} "
              f"{r['both_busy_default_over_quiet_1thread']:15.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernels", default="native,onnxruntime")
    parser.add_argument("--variants", default="ours=")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "contention.json")
    args = parser.parse_args()
    info = machine_info()
    records = run_cases(args)
    rows = print_table(medians(records))
    write_json(args.out, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                          "rows": rows, "records": records})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
