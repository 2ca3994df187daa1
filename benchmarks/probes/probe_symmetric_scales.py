"""Which scale a symmetric int4 block should take, measured before changing the compiler's.

`compiler/quant_format.py` used to scale a symmetric block by absmax / 7.5: both extremes
land on ±7.5 and round to -8 or (clamped) 7. llama.cpp's Q4_0 and ONNX Runtime's blockwise
quantizer instead map the block's extreme value, with its sign, onto -8 (scale = extreme /
-8, negative when the extreme is positive): eight steps on that side instead of 7.5, and
no clipped extreme. This probe rounds every linear of SmolLM2 (decoder and tied LM head,
round to nearest, no calibration) both ways, in torch with float activations, and scores
WikiText-2 test windows of 512 tokens (the shared protocol, fewer windows by default).
Prints a table; writes benchmarks/results/probe_symmetric_scales.json. The compiler takes
extreme / -8 since this probe measured it (quant_format.quant_params).

    python benchmarks/probes/probe_symmetric_scales.py --windows 16 --groups 32,64,128
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common and the benchmarks
from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json  # noqa: E402
from _int4_models import ensure_hf_dir  # noqa: E402
from bench_int4 import DEFAULT_RECIPE, package_gguf  # noqa: E402

TEST_SPLIT = REPO_ROOT.parent / "shared" / "data" / "wikitext2-test.raw.txt"
SEQ_LEN = 512


def round_blocks(w: torch.Tensor, group: int, rule: str) -> torch.Tensor:
    """w [N, K] rounded to 4-bit codes in blocks of `group` and back (a shorter last block
    as MatMulNBits has it: padded with zeros, which change neither rule's scale)."""
    n, k = w.shape
    blocks = torch.nn.functional.pad(w, (0, -k % group)).reshape(n, -1, group)
    if rule == "absmax/7.5":
        scale = blocks.abs().amax(-1, keepdim=True) / 7.5
    else:  # "extreme/-8": the value of largest magnitude, with its sign, onto code -8
        extreme = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))
        scale = extreme / -8
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    rounded = torch.clamp(torch.round(blocks / scale), -8, 7) * scale
    return rounded.reshape(n, -1)[:, :k]


def perplexity(model: torch.nn.Module, ids: torch.Tensor, windows: int) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            x = ids[w * SEQ_LEN:(w + 1) * SEQ_LEN][None]
            nll += model(x, labels=x).loss.item() * (SEQ_LEN - 1)
            count += SEQ_LEN - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--out-dir", type=Path, default=Path("out/int4-bench"),
                        help="where bench_int4 keeps the float HF directory of the GGUF")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = ensure_hf_dir(package_gguf(Path(DEFAULT_RECIPE)), args.out_dir / "smollm2-hf")
    text = TEST_SPLIT.read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(hf_dir)(text, add_special_tokens=False,
                                                 return_tensors="pt").input_ids[0]
    rows = []
    print(f"{'group':>6}  {'rule':<12}{'ppl':>9}")
    for group in (int(g) for g in args.groups.split(",")):
        for rule in ("absmax/7.5", "extreme/-8"):
            started = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.weight.copy_(round_blocks(module.weight, group, rule))
            ppl = perplexity(model, ids, args.windows)
            rows.append({"group": group, "rule": rule, "ppl": ppl,
                         "seconds": time.perf_counter() - started})
            print(f"{group:>6}  {rule:<12}{ppl:>9.2f}", flush=True)
    write_json(RESULTS_DIR / "probe_symmetric_scales.json",
               {"machine": machine_info(), "windows": args.windows, "seq_len": SEQ_LEN,
                "rows": rows})


if __name__ == "__main__":
    main()
