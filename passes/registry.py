"""The one registry of passes: recipe keys are exactly these names.

Each entry names the module that holds the pass. A pass module defines a frozen
pydantic `Config` and `run(ir, config, context) -> PassResult`; it is imported only
when a recipe uses it, so heavy dependencies load lazily. An import error is an
error, never a silent skip.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class PassEntry:
    module: str  # e.g. "llmopt.passes.rtn"
    requires: tuple[str, ...] = ()  # facts earlier passes must provide
    provides: tuple[str, ...] = ()


PASSES: dict[str, PassEntry] = {
    # Weight quantization: one per recipe.
    "rtn": PassEntry("llmopt.passes.rtn", provides=("quantized_weights",)),
    "gguf_weights": PassEntry("llmopt.passes.gguf_weights", provides=("quantized_weights",)),
    "awq": PassEntry("llmopt.passes.awq", provides=("quantized_weights",)),
    "gptq": PassEntry("llmopt.passes.gptq", provides=("quantized_weights",)),
    # KV cache storage dtype (float16, fp8, int8, int4), per layer.
    "kv_cache": PassEntry("llmopt.passes.kv_cache", provides=("kv_cache",)),
    # Speculative decoding: pair a draft with the (final) target; must come last.
    "draft": PassEntry("llmopt.passes.draft", provides=("draft",)),
}


@dataclass
class PassResult:
    ir: Any  # the rewritten ModelIR
    report: dict[str, Any] = field(default_factory=dict)  # what changed and what it cost


def load_pass(name: str) -> ModuleType:
    return importlib.import_module(PASSES[name].module)
