"""The native step's projections on AMX tiles against its VNNI loop, one projection at a time.

    python benchmarks/amx_projections.py [--threads 1] [--rows 1,2,4,8,16,64,512] [--block 32]

SmolLM2-135M's projection shapes (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down
576 x 1536 with 4-bit codes; the LM head 49152 x 576 with 8-bit codes), random symmetric
weights quantized in blocks of --block columns (K 576 in blocks of 128: four, then one of
64), random activations of `rows` rows: `llmopt_linear` with AMX off and on, interleaved,
the best of 5 timings of a batch of calls each; the two paths' outputs are checked equal,
bit for bit. Every row count takes the tiles here (a step takes them from kernels.c's
AMX_MIN_ROWS rows on: this table is where that threshold comes from).
Prints a table and writes benchmarks/results/amx_projections.json (_block64, _block128).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from _common import RESULTS_DIR, machine_info, write_json

from llmopt.runtime.native.library import amx_available, default_knobs, kernels
from llmopt.runtime.native.weights import quantized_matrix

SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4),
          "down": (576, 1536, 4), "head (8-bit)": (49152, 576, 8)}
MACS_PER_BATCH = 2e8  # multiply-adds timed per measurement: milliseconds at any shape


def random_matrix(n: int, k: int, bits: int, block: int, rng: np.random.Generator):
    """MatMulNBits-packed random symmetric codes (two 4-bit codes a byte, low nibble first;
    the last block padded) and scales, as the native step's QMatrix (with the arrays it
    points at)."""
    blocks = -(-k // block)
    codes = np.zeros((n, blocks * block), np.uint8)
    codes[:, :k] = rng.integers(0, 2 ** bits, (n, k), dtype=np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    packed = codes.reshape(n, blocks, block * bits // 8)
    scales = rng.uniform(1e-3, 2e-2, (n, blocks)).astype(np.float32)
    return quantized_matrix(packed, scales.reshape(-1), None, n, k, bits, block=block)


def timed_ms(lib: ctypes.CDLL, matrix, x: np.ndarray, y: np.ndarray, threads: int,
             calls: int, knobs) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        lib.llmopt_linear(ctypes.byref(matrix), x.ctypes.data, x.shape[0], y.ctypes.data,
                          threads, knobs)
    return 1000 * (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,64,512")
    parser.add_argument("--block", type=int, choices=(32, 64, 128), default=32,
                        help="columns per quantization block")
    args = parser.parse_args()
    lib = kernels()
    if lib is None or not amx_available():
        raise SystemExit("this install has no native kernels, or this CPU no AMX int8 tiles")
    knobs = default_knobs()
    knobs.amx_min_rows = 1
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"{'projection':<14}{'rows':>6}{'VNNI ms':>10}{'AMX ms':>10}{'AMX/VNNI':>10}")
    for name, (n, k, bits) in SHAPES.items():
        arrays, matrix = random_matrix(n, k, bits, args.block, rng)
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            outputs = {amx: np.empty((rows, n), np.float32) for amx in (False, True)}
            calls = max(3, int(MACS_PER_BATCH // (n * k * rows)))
            best = {False: float("inf"), True: float("inf")}
            for round_ in range(10):
                for amx in (False, True) if round_ % 2 else (True, False):
                    knobs.amx = amx
                    best[amx] = min(best[amx], timed_ms(lib, matrix, x, outputs[amx],
                                                        args.threads, calls, knobs))
            if not np.array_equal(outputs[False], outputs[True]):
                raise SystemExit(f"{name} at {rows} rows: AMX and VNNI results differ")
            ratio = best[True] / best[False]
            print(f"{name:<14}{rows:>6}{best[False]:>10.3f}{best[True]:>10.3f}{ratio:>10.2f}")
            rows_out.append({"projection": name, "n": n, "k": k, "bits": bits, "rows": rows,
                             "vnni_ms": best[False], "amx_ms": best[True],
                             "amx_over_vnni": ratio})
    name = "amx_projections" + ("" if args.block == 32 else f"_block{args.block}")
    write_json(RESULTS_DIR / f"{name}.json", {"machine": machine_info(), "threads": args.threads,
                                              "block": args.block, "rows": rows_out})


if __name__ == "__main__":
    main()
