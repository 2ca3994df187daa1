"""Helpers shared by the benchmark scripts: machine description, worker subprocesses, C probes,
JSON."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
PACKAGES = ("llmopt", "torch", "transformers", "onnxruntime", "numpy", "tokenizers", "onnx")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def machine_info(extra_packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """CPU model and flags, core counts, package versions and the git commit."""
    return {
        "cpu_model": _cpuinfo_field("model name"),
        "cpu_flags": [f for f in CPU_FLAGS if f in _cpuinfo_field("flags").split()],
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in (*PACKAGES, *extra_packages)},
        "git_commit": _git("rev-parse", "HEAD"),
        "git_modified_files": _git("status", "--porcelain", "--untracked-files=no").splitlines(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment with every OpenMP/BLAS pool pinned to `threads`."""
    return {**os.environ, **{var: str(threads) for var in THREAD_ENV_VARS}}


def run_json_worker(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run `python <args>` in a fresh process; its last stdout line is one JSON object."""
    proc = subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"worker {args} failed with exit code {proc.returncode}")
    return json.loads(lines[-1])


def compile_artifact(path: Path, recipe: Path, overrides: list[str],
                     recompile: bool = False) -> Path:
    """`path`, compiled from `recipe` with `--set` overrides through the llmopt CLI unless it
    already holds an artifact (or `recompile`: then built beside it and swapped in). The
    compiler's default quality measurement is off unless an override sets `quality`:
    benchmarks measure speed here, and quality on the shared protocol elsewhere."""
    if (path / "manifest.json").is_file() and not recompile:
        return path
    if not any(o.startswith("quality") for o in overrides):
        overrides = [*overrides, "quality.measure=false"]
    fresh = path.with_name(path.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    cmd = [sys.executable, "-c", "from llmopt.cli import main; main()", "compile", str(recipe),
           "-o", str(fresh), *[a for o in overrides for a in ("--set", o)]]
    print(f"compiling {path} ...", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"compiling {path} failed:\n{proc.stderr[-4000:]}")
    shutil.rmtree(path, ignore_errors=True)
    fresh.rename(path)
    print(f"compiled {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def save_plain_hf(loaded: Any, tokenizer: Any, directory: Path) -> None:
    """Save a GGUF-loaded (already dequantized) transformers model as a plain fp32 HF dir.

    transformers marks a GGUF-loaded model as quantized and refuses to save it: copy the
    weights into a plain model of the same config.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def median_rows(records: list[dict[str, Any]], metrics: tuple[str, ...],
                key: str = "batch") -> list[dict[str, Any]]:
    """Median (and min/max) of each metric over rounds, per (system, `key`, threads)."""
    samples: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    for record in records:
        for r in record["results"]:
            samples.setdefault((record["system"], r[key], record["threads"]), []).append(r)
    rows = []
    for (system, value, threads), runs in samples.items():
        row: dict[str, Any] = {"system": system, key: value, "threads": threads,
                               "rounds": len(runs)}
        for metric in metrics:
            values = [run[metric] for run in runs]
            row[metric] = statistics.median(values)
            row[metric + "_range"] = [min(values), max(values)]
        rows.append(row)
    return rows


def process_peak_rss_mib() -> float:
    """This process's peak RSS since it started (VmHWM). Not ru_maxrss: Linux carries that
    over from the parent across fork + exec, so a worker would report its driver's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return platform.processor() if name == "model name" else ""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return ""
    return out.stdout.strip()


def build_c_probe(source: Path, flags: list[str], directory: Path) -> Path:
    """`source` built with the system C compiler and `flags` into `directory` (SystemExit
    without a compiler, CalledProcessError where the build fails)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) on PATH")
    binary = directory / source.stem
    subprocess.run([compiler, *flags, "-o", str(binary), str(source)], check=True)
    return binary


def probe_values(output: str) -> dict[str, float]:
    """A probe's printed "name value" pairs."""
    words = output.split()
    return {name: float(v) for name, v in zip(words[0::2], words[1::2], strict=True)}


def run_c_probe(source: Path, flags: list[str], reps: int, rounds: int,
                refusal: str) -> list[dict[str, float]]:
    """`source` built (build_c_probe), then run `rounds` times with `reps` as its argument;
    each run's "name value" pairs. A run that fails, or prints one word instead (the CPU
    lacks what the probe needs), ends the script with `refusal`."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_c_probe(source, flags, Path(tmp))
        for _ in range(rounds):
            result = subprocess.run([str(binary), str(reps)], capture_output=True, text=True)
            if result.returncode or len(result.stdout.split()) < 2:
                raise SystemExit(refusal)
            runs.append(probe_values(result.stdout))
    return runs
