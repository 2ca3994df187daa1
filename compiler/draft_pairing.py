"""Draft pairing, the compiler's phase after the passes: build (or load) a draft, run its
own passes, measure the pairing against the final target as the artifact will run it,
and choose γ. The recipe's `- draft: {...}` entry (its last) configures it; the work is
the `llmopt.passes.draft` library's, handed what it needs here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.compiler.artifact import save_graph
from llmopt.compiler.ir import DraftBundle, ModelIR
from llmopt.compiler.lower import lower
from llmopt.compiler.pass_manager import PassContext, apply_passes, options_line
from llmopt.compiler.pass_registry import PassStep
from llmopt.compiler.recipe import Recipe
from llmopt.passes import draft as library
from llmopt.passes.draft import choice
from llmopt.passes.draft.config import Config, NgramDraft
from llmopt.runtime.executors.choose import graph_executor
from llmopt.runtime.executors.step_batch import Executor
from llmopt.runtime.manifest import GraphSpec


def pair_draft(ir: ModelIR, step: PassStep, context: PassContext
               ) -> tuple[ModelIR, dict[str, Any]]:
    """The IR with its draft paired, and the entry's report (as a pass reports)."""
    started = time.perf_counter()
    context.log(f"      {step.name}: {options_line(step.config)}")
    out, report = _pair(ir, step.config, context)
    return out, {"name": step.name, "config": step.config.model_dump(mode="json"),
                 "seconds": round(time.perf_counter() - started, 3), **report}


def _pair(ir: ModelIR, config: Config, context: PassContext
          ) -> tuple[ModelIR, dict[str, Any]]:
    started = time.perf_counter()
    inputs = pairing_inputs(context.recipe, context.log)
    report: dict[str, Any] = {"kind": config.kind}
    draft, token_map = None, None
    if not isinstance(config, NgramDraft):
        draft, token_map = library.build_draft(ir, config, inputs, report)
        if config.passes:  # in the target's context: one quality probe for the compile
            draft, report["passes"] = apply_passes(draft, config.passes, context)
        report["draft"] = library.draft_summary(draft, token_map)
    corpus = library.ngram_corpus(ir, config, inputs, report)
    speculative = library.measure_pairing(ir, draft, token_map, config, inputs, corpus)
    if draft is not None and not config.keep_unpaid_model and choice.ngram_alone_pays_more(
            speculative):
        report["model_dropped"] = _model_dropped(speculative, config.kind)
        context.log(f"      draft: {report['model_dropped']}")
        speculative, draft, token_map = choice.without_model(speculative), None, None
    ngram = config.ngram_options()
    speculative["ngram"] = ngram.model_dump() if ngram else None
    report["speculative"] = speculative
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    library.log_summary(speculative, context.log)
    out = ir.copy()
    out.draft = DraftBundle(config.kind, draft, token_map, speculative, corpus)
    return out, report


def _model_dropped(speculative: dict[str, Any], kind: str) -> str:
    alone = speculative["measured"]["ngram_only"]["predicted_speedup"][0]
    return (f"n-gram drafts alone were predicted {alone}x at batch 1, with the {kind} "
            f"draft as their fallback {speculative['predicted_speedup']}x: the artifact keeps "
            "no draft model (keep_unpaid_model: true keeps it)")


def pairing_inputs(recipe: Recipe, log: Callable[[str], None]) -> library.PairingInputs:
    """What the draft library reads: the recipe, the log, and models run as the artifact
    will hold them."""
    def executor(ir: ModelIR, path: Path, num_blocks: int, lane_blocks: int) -> Executor:
        return lowered_executor(ir, recipe, path, num_blocks, lane_blocks)

    return library.PairingInputs(recipe, log, executor)


def lowered_executor(ir: ModelIR, recipe: Recipe, path: Path, num_blocks: int,
                     lane_blocks: int) -> Executor:
    """The model lowered as the artifact will hold it, run as the runtime runs it by default
    (`kernels: auto`): by the native step where it can run here, else by ONNX Runtime's
    executor. The step costs measured are the ones the engine's pricing starts from, and
    the two kernels' costs differ in shape (a native 8-token step is relatively cheaper).
    Lanes-layout sequences get `lane_blocks` blocks each."""
    lowered = lower(ir, recipe)
    graph = GraphSpec.model_validate(save_graph(lowered, path))
    return graph_executor(path.parent, graph, lowered.kv_cache, kernels="auto",
                          num_blocks=num_blocks, block_size=recipe.runtime.block_size,
                          lane_blocks=lane_blocks, max_position=lowered.options.max_position)

