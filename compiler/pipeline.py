"""The compile pipeline, in one page: load → passes → lower → write the artifact."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmopt.compiler.artifact import staging_directory, write_artifact
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.lower import lower_to_onnx, lowering_options
from llmopt.compiler.preflight import check_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import spec_summary
from llmopt.passes.registry import PassContext, PassStep, check_order, load_pass
from llmopt.runtime.manifest import Manifest


class QualityBudgetError(ValueError):
    """A lossy pass cost more than the recipe's quality budget allows."""


def compile_recipe(recipe: Recipe, out: Path, log: Callable[[str], None] = print) -> Manifest:
    check_recipe(recipe, out)  # before any work
    # Phase 1: load the checkpoint into the IR.
    started = time.perf_counter()
    log(f"[1/3] loading {recipe.model}")
    ir = load_checkpoint(recipe.model)
    log(f"      {spec_summary(ir.arch)}, {ir.num_parameters() / 1e6:.1f} M parameters "
        f"({time.perf_counter() - started:.1f} s)")
    if ir.tokenizer_spec is not None:
        log(f"      tokenizer: {ir.tokenizer_spec.summary()}")
        for note in ir.tokenizer_spec.notes:  # where the source was ambiguous
            log(f"      note: {note}")
    # Phase 2: rewrite and quantize, in recipe order.
    ir, reports = run_passes(ir, recipe, log)
    # Phase 3: lower to ONNX and write the artifact atomically.
    log(f"[3/3] lowering to ONNX ({recipe.target.operator_set} operators, "
        f"{recipe.target.weight_dtype} weights) and writing {out}")
    graphs = {"target": (lower_to_onnx(ir, lowering_options(recipe, ir.arch)),
                         recipe.target.operator_set)}
    if ir.draft is not None and ir.draft.ir is not None:  # the draft: same operators, own IR
        draft = ir.draft.ir
        graphs["draft"] = (lower_to_onnx(draft, lowering_options(recipe, draft.arch)),
                           recipe.target.operator_set)
    with staging_directory(out) as staging:
        manifest = write_artifact(staging, ir, graphs, recipe, reports)
    log(f"      done in {time.perf_counter() - started:.1f} s")
    return manifest


def run_passes(
    ir: ModelIR, recipe: Recipe, log: Callable[[str], None]
) -> tuple[ModelIR, list[dict[str, Any]]]:
    log(f"[2/3] running {len(recipe.passes)} pass(es)")
    if recipe.passes:
        log(f"      quality of lossy passes: {recipe.quality_source()}")
    return apply_passes(ir, recipe.passes, PassContext(recipe, log, apply_passes))


def apply_passes(
    ir: ModelIR, steps: Sequence[PassStep], context: PassContext
) -> tuple[ModelIR, list[dict[str, Any]]]:
    """Run validated passes in order (a draft's own passes too, through its context)."""
    reports = []
    for name, config in steps:
        started = time.perf_counter()
        context.log(f"      {name}: {options_line(config)}")
        result = load_pass(name).run(ir, config, context)
        ir = result.ir
        report = {"name": name, "config": config.model_dump(mode="json"),
                  "seconds": round(time.perf_counter() - started, 3), **result.report}
        reports.append(report)
        check_budget(name, report, pass_budget(config, context.recipe.quality.max_ppl_increase_pct),
                     context.log)
    return ir, reports


def options_line(config: Any) -> str:
    """The options the recipe set; the rest are listed in the resolved recipe printed
    before (a draft has a dozen that do not all apply to its kind)."""
    given, every = config.model_dump(exclude_unset=True), config.model_dump()
    return str(given) if given == every else f"{given} (other options at their defaults)"


def pass_budget(config: Any, recipe_budget: float | None) -> float | None:
    """The tighter of the recipe's budget and the pass's own `max_ppl_increase_pct`."""
    budgets = [b for b in (recipe_budget, getattr(config, "max_ppl_increase_pct", None))
               if b is not None]
    return min(budgets, default=None)


def check_budget(name: str, report: dict[str, Any], budget: float | None,
                 log: Callable[[str], None]) -> None:
    quality = report.get("quality")
    if "quality" in report and quality is None:
        log(f"      {name}: quality not measured (quality.measure is false)")
    if not quality:
        return
    log(f"      {name}: {quality_line(quality)}")
    if budget is not None and quality["ppl_increase_pct"] is None:
        log(f"      {name}: no perplexity to hold to the budget of {budget} %")
    elif budget is not None and quality["ppl_increase_pct"] > budget:
        raise QualityBudgetError(
            f"pass {name!r} raised perplexity by {quality['ppl_increase_pct']:.2f} %, over the "
            f"recipe's quality.max_ppl_increase_pct of {budget} % (no artifact written)")


def quality_line(quality: dict[str, Any]) -> str:
    """`perplexity a -> b (+x %), KL k, top-1 agreement t %` and what it was measured on."""
    samples = quality.get("perplexity_on") == "model samples"
    ppl = "perplexity of its own samples" if samples else "perplexity"
    caveat = "; not a text perplexity" if samples else ""
    line = (f"{ppl} {quality['ppl_before']} -> {quality['ppl_after']} "
            f"({quality['ppl_increase_pct']:+.2f} %{caveat}), " if quality["ppl_before"]
            is not None else f"perplexity {quality['perplexity_on']}; ")
    line += (f"KL {quality['kl']}, top-1 agreement {100 * quality['top1_agreement']:.1f} %")
    return f"{line}; on {quality['source']}" if "source" in quality else line


def check_pass_order(recipe: Recipe) -> None:
    """The registry's constraints between passes, checked before any work starts."""
    check_order([step.name for step in recipe.passes])
