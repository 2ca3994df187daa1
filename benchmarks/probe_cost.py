"""What the compile's default quality probe costs: the same recipe compiled with the probe
and with `quality.measure: false`, interleaved round by round in one run, so each ratio
sees the same machine load. Prints a table and writes JSON.

    python benchmarks/probe_cost.py RECIPE [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, machine_info, thread_env, write_json

MODES = {"probe": [], "no probe": ["--set", "quality.measure=false"]}


def compile_once(recipe: Path, extra: list[str], out: Path, threads: int) -> dict[str, Any]:
    """One `llmopt compile`: wall seconds, the probe's own seconds from the log, the load."""
    load = os.getloadavg()[0]
    started = time.perf_counter()
    llmopt = Path(sys.executable).parent / "llmopt"  # the console script beside this python
    proc = subprocess.run([str(llmopt), "compile", str(recipe), "-o", str(out), *extra],
                          env=thread_env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"compile failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    probe_s = sum(float(s) for s in re.findall(r"quality: \d+/\d+ windows, (\d+) s", proc.stdout))
    return {"wall_s": round(wall, 2), "probe_log_s": probe_s, "load": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "probe_cost.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(dir=args.json.parent) as scratch:
        for round_ in range(args.rounds):
            for mode, extra in MODES.items():
                out = Path(scratch) / f"{round_}-{mode.replace(' ', '-')}"
                runs[mode].append(compile_once(args.recipe, extra, out, args.threads))
                print(f"round {round_ + 1} {mode}: {runs[mode][-1]}", flush=True)
    medians = {mode: statistics.median(r["wall_s"] for r in rs) for mode, rs in runs.items()}
    added = 100 * (medians["probe"] / medians["no probe"] - 1)
    print("\n| recipe | threads | with probe | without | added | loads |\n"
          f"|---|---|---|---|---|---|\n| {args.recipe.name} | {args.threads} | "
          f"{medians['probe']:.1f} s | "
          f"{medians['no probe']:.1f} s | {added:+.1f} % | "
          f"{min(r['load'] for rs in runs.values() for r in rs)}-"
          f"{max(r['load'] for rs in runs.values() for r in rs)} |")
    write_json(args.json, {"machine": machine_info(), "recipe": str(args.recipe),
                           "threads": args.threads, "runs": runs, "median_wall_s": medians,
                           "added_pct": round(added, 2)})


if __name__ == "__main__":
    main()
