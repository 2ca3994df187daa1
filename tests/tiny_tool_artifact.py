"""A tiny random Qwen2 artifact with Qwen2.5's real, tool-capable chat template and an
n-gram draft: what the structured-output and tool-call tests run on (its byte-level
tokenizer can write any JSON; the grammar, not the random weights, makes it valid)."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_checkpoints import build_family_checkpoint

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe

QWEN2_5_TEMPLATE = Path(__file__).parent / "templates" / "qwen2_5.jinja"
NGRAM_DRAFT = {"kind": "ngram", "gamma": 3, "prompts": 2, "new_tokens": 12,
               "batch_sizes": [1, 2], "cost_repeats": 1}


def build_tool_artifact(root: Path, max_context: int = 2048) -> Path:
    checkpoint = build_family_checkpoint("qwen2", root / "checkpoint")["hf"]
    (checkpoint / "chat_template.jinja").write_text(QWEN2_5_TEMPLATE.read_text())
    config = json.loads((checkpoint / "config.json").read_text())
    config["max_position_embeddings"] = max_context  # a tool prompt is long in 400 tokens
    rope = config.get("rope_parameters") or {}
    if "original_max_position_embeddings" in rope:  # keep YaRN's stated factor consistent
        rope["original_max_position_embeddings"] = max_context // int(rope["factor"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    recipe = Recipe(model=str(checkpoint), passes=[{"draft": NGRAM_DRAFT}],
                    runtime={"block_size": 4, "max_context": max_context, "max_num_seqs": 16})
    out = root / "artifact"
    compile_recipe(recipe, out, log=lambda _: None)
    return out
