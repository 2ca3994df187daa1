"""Sliding-window layers at long context: KV held per sequence before (every block kept)
and after (the local group's blocks behind the window given back) on a Gemma-3-shaped
random model over the blocks layout; and (`--layout lanes`) the native step reading only
each query's window against ONNX Runtime on a Mistral-style model over KV lanes.

The model: a random `gemma3_text` checkpoint with Gemma 3's layer pattern (five sliding
layers of window `--window` to one full-attention layer): `--shape small` has small widths
so that it runs fast on a CPU, `--shape gemma-3-270m` Gemma-3-270M's (18 layers, hidden
640, one KV head of 256, vocabulary 262,144; random weights: valid for memory and speed).
One prompt of `--context` random tokens is prefilled and `--gen` greedy tokens decoded,
once with freeing and once with a window no sequence outgrows (the engine before the
change: the same graph, nothing freed). Reported per run: blocks held per layer
group at the end, the KV bytes a sequence holds, the bytes the local group's pool takes
against the full pool's, decode tok/s; and whether the tokens are equal.

`--layout lanes`: a random `mistral` checkpoint (every layer a sliding window of
`--window`, Mistral's rule) of `--shape smollm2`, SmolLM2-135M's widths (30 layers, hidden
576, 9 heads, 3 KV heads of 64, vocabulary 49,152), compiled as the native recipes are (RTN
int4 in groups of 32, an 8-bit head, int8 activations, float32 lanes). The same prompt and
greedy decode on the native step and on ONNX Runtime (`--threads` each): prefill seconds,
decode tok/s, the KV bytes a sequence's lane holds (every layer's), whether the tokens
are equal.

    python benchmarks/bench_sliding_window.py --out-dir /tmp/swbench
    python benchmarks/bench_sliding_window.py --out-dir /tmp/sw270m --shape gemma-3-270m \
        --context 32000
    python benchmarks/bench_sliding_window.py --out-dir /tmp/swlanes --layout lanes \
        --shape smollm2 --window 4096 --context 8000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS_DIR, machine_info, write_json

from llmopt.runtime import LLM, SamplingParams

_MIB = 1024 * 1024


# Widths by --shape; the layer count and window come from the command line.
SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64),
    "gemma-3-270m": dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, vocab_size=262144,
                         query_pre_attn_scalar=256, rope_theta=1_000_000.0,
                         rope_local_base_freq=10_000.0),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    rope_theta=100_000.0),
}
DEFAULT_LAYERS = {"small": 12, "gemma-3-270m": 18, "smollm2": 30}
# the native recipes' weights: RTN int4 in groups of 32, an 8-bit head, int8 activations
NATIVE_PASSES = [{"rtn": {"bits": 4, "group_size": 32, "symmetric": True,
                          "include_lm_head": True, "lm_head_bits": 8}}]


def build_checkpoint(directory: Path, shape: str, layers: int, window: int,
                     max_position: int, layout: str) -> Path:
    """A random checkpoint and a byte-level tokenizer: Gemma-3-shaped (blocks), or a
    Mistral with a window on every layer (lanes)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_checkpoints import build_tiny_checkpoint

    if layout == "lanes":
        return build_tiny_checkpoint("mistral", directory, overrides=dict(
            SHAPES[shape], num_hidden_layers=layers, sliding_window=window,
            max_position_embeddings=max_position))

    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                   for i in range(layers)]
    return build_tiny_checkpoint("gemma3_text", directory, overrides=dict(
        SHAPES[shape], num_hidden_layers=layers, layer_types=layer_types,
        sliding_window=window, max_position_embeddings=max_position))


def compile_artifact(checkpoint: Path, out: Path, max_context: int, block_size: int,
                     layout: str) -> Path:
    """Float weights over blocks, or the native recipes' over lanes."""
    from llmopt.compiler.pipeline import compile_recipe
    from llmopt.compiler.recipe import Recipe

    if not (out / "manifest.json").exists():
        runtime = {"block_size": block_size, "max_context": max_context, "max_num_seqs": 1}
        recipe = (Recipe(model=str(checkpoint), target={"kv_layout": "blocks"},
                         runtime=runtime) if layout == "blocks"
                  else Recipe(model=str(checkpoint), passes=NATIVE_PASSES,
                              target={"nbits_accuracy_level": 4}, runtime=runtime,
                              quality={"measure": False}))
        compile_recipe(recipe, out, log=lambda _: None)
    return out


def run(artifact: Path, prompt: list[int], gen: int, keep: bool) -> dict[str, Any]:
    """Prefill and decode one sequence; what it holds at the end and how fast it decoded."""
    from llmopt.runtime import assembly

    sized = assembly.num_local_blocks
    if keep:  # the engine before the change: local pools as large as the full ones
        assembly.num_local_blocks = lambda config, window, trails: config.num_blocks
    try:
        llm = LLM(artifact, max_num_seqs=1, speculative=False)
    finally:
        assembly.num_local_blocks = sized
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    if keep:  # ... and nothing ever behind the window
        kv.sliding.window = 10**9
    engine.add_request(prompt, SamplingParams(max_tokens=gen, temperature=0.0,
                                              ignore_eos=True))
    held, tokens, first = {}, [], None
    while engine.has_unfinished_requests():
        if engine.scheduler.running:
            held = kv.blocks_held(engine.scheduler.running[0])
        for output in engine.step():
            first = first or time.perf_counter()
            tokens = output.token_ids
    decode_s = time.perf_counter() - first
    return {"tokens": tokens, "held_blocks": held, "decode_tok_s": (gen - 1) / decode_s,
            **memory(llm, held)}


def memory(llm: LLM, held: dict[str, int]) -> dict[str, Any]:
    """Bytes a block takes in each group's pools, what the sequence holds, the pools' size."""
    pools = llm.engine.executor.pools
    local = set(pools.local_flat)
    block_bytes = {"full": 0, "sliding": 0}
    pool_bytes = {"full": 0, "sliding": 0}
    for new, past in pools.new_to_past.items():
        group = "sliding" if new in local else "full"
        array = pools.arrays[past]
        block_bytes[group] += array[0].nbytes
        pool_bytes[group] += array.nbytes
    return {"held_bytes": {g: held.get(g, 0) * block_bytes[g] for g in block_bytes},
            "pool_bytes": pool_bytes}


def run_lanes(artifact: Path, prompt: list[int], gen: int, kernels: str,
              threads: int) -> dict[str, Any]:
    """Prefill and decode one sequence on `kernels`: seconds, tok/s, its lane's KV bytes."""
    llm = LLM(artifact, max_num_seqs=1, speculative=False, kernels=kernels,
              num_threads=threads)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=gen, temperature=0.0,
                                              ignore_eos=True))
    started, first, tokens = time.perf_counter(), None, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            first = first or time.perf_counter()
            tokens = output.token_ids
    assert first is not None
    lane_bytes = sum(array[0].nbytes for array in engine.executor.pools.arrays.values())
    return {"tokens": tokens, "prefill_s": first - started,
            "decode_tok_s": (gen - 1) / (time.perf_counter() - first),
            "lane_kv_bytes": lane_bytes, "kernels": llm.kernels_in_use()}


def lanes_main(args: argparse.Namespace, artifact: Path, prompt: list[int]) -> None:
    results = {k: run_lanes(artifact, prompt, args.gen, k, args.threads)
               for k in ("native", "onnxruntime")}
    same = results["native"]["tokens"] == results["onnxruntime"]["tokens"]
    ratio = results["native"]["decode_tok_s"] / results["onnxruntime"]["decode_tok_s"]
    print(f"mistral-style {args.shape}: {args.layers} layers, window {args.window} on each, "
          f"context {args.context} + {args.gen} decoded, {args.threads} thread(s); tokens "
          f"equal: {same}; native / onnxruntime decode: {ratio:.2f}x")
    print("| kernels | prefill s | decode tok/s | KV a lane holds MiB |")
    print("|---|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['prefill_s']:.1f} | {result['decode_tok_s']:.2f} | "
              f"{result['lane_kv_bytes'] / _MIB:.1f} |")
        result.pop("tokens")
    write_json(RESULTS_DIR / "sliding_window_lanes.json",
               {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
                "tokens_equal": same, "native_over_onnxruntime": ratio, "results": results})


def row(name: str, result: dict[str, Any]) -> str:
    held, hb, pb = result["held_blocks"], result["held_bytes"], result["pool_bytes"]
    return (f"| {name} | {held['full']} | {held['sliding']} | "
            f"{(hb['full'] + hb['sliding']) / _MIB:.2f} | {(pb['full'] + pb['sliding']) / _MIB:.1f}"
            f" | {result['decode_tok_s']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--layout", choices=["blocks", "lanes"], default="blocks")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--layers", type=int, default=None,
                        help="default: 12 for small, 18 for gemma-3-270m, 30 for smollm2")
    parser.add_argument("--threads", type=int, default=1, help="lanes: each run's threads")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", default="before,after",
                        help="which runs: 'after' alone skips the slow keep-everything run")
    args = parser.parse_args()
    args.layers = args.layers or DEFAULT_LAYERS[args.shape]
    max_context = args.context + args.gen + args.block_size
    checkpoint = args.out_dir / "checkpoint"
    if not (checkpoint / "config.json").exists():
        build_checkpoint(checkpoint, args.shape, args.layers, args.window, max_context,
                         args.layout)
    artifact = compile_artifact(checkpoint, args.out_dir / "artifact", max_context,
                                args.block_size, args.layout)
    prompt = np.random.default_rng(0).integers(3, 256, args.context).tolist()
    if args.layout == "lanes":
        lanes_main(args, artifact, prompt)
        return
    results = {name: run(artifact, prompt, args.gen, keep=name == "before")
               for name in args.runs.split(",")}
    same = (results["before"]["tokens"] == results["after"]["tokens"]
            if {"before", "after"} <= set(results) else None)
    print(f"{args.shape}: {args.layers} layers (1 full : 5 sliding, window {args.window}), context "
          f"{args.context} + {args.gen} decoded, blocks of {args.block_size}; "
          f"tokens equal: {same}")
    print("| run | full blocks | sliding blocks | KV held MiB | pools MiB | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        print(row(name, result))
    for result in results.values():
        result.pop("tokens")
    write_json(RESULTS_DIR / "sliding_window.json",
               {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
                "tokens_equal": same, "results": results})


if __name__ == "__main__":
    main()
