"""The pass manager: what a pass reads besides the IR (`PassContext`), what it returns
(`PassResult`), and running validated passes in order against the quality budget.

The registry it runs from is `pass_registry` (the recipe validates against it, below
this module).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.pass_registry import PassStep, load_pass
from llmopt.compiler.quality_sources import QualityProbes, samples_line
from llmopt.compiler.recipe import Recipe


class QualityBudgetError(ValueError):
    """A lossy pass cost more than the recipe's quality budget allows."""


@dataclass
class PassResult:
    ir: ModelIR  # the rewritten IR
    report: dict[str, Any] = field(default_factory=dict)  # what changed and what it cost


@dataclass
class PassContext:
    """What a pass may read besides the IR: the recipe, the compile log, and held-out text
    to measure its cost on."""

    recipe: Recipe
    log: Callable[[str], None]
    _probe: QualityProbes | None = None

    def quality_probe(self, ir: ModelIR) -> QualityProbes | None:
        """What to measure a pass's cost on: samples of the first measured pass's input
        model, and `quality.eval_text` (else the tail of `calibration.text`) when there is
        one; built once per compile. None with `quality.measure: false`."""
        if self._probe is None:
            self._probe = QualityProbes.for_recipe(self.recipe, ir, self.log)
        return self._probe


def apply_passes(
    ir: ModelIR, steps: Sequence[PassStep], context: PassContext
) -> tuple[ModelIR, list[dict[str, Any]]]:
    """Run validated passes in order (a draft's own passes too, in the same context)."""
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


# Below this share of the input model's top-1 choices, generated text visibly drifts.
LOW_TOP1_AGREEMENT = 0.80
# What keeps more of the input model, per lossy pass, for the warning below.
BETTER_CHOICES = {
    "rtn": "a calibrated pass (gptq or awq), group_size: 32 or an 8-bit LM head "
           "(lm_head_bits: 8) keeps more",
    "gptq": "group_size: 32 or 64, an 8-bit LM head (lm_head_bits: 8) or bits: 8 keeps more",
    "awq": "group_size: 32 or 64, an 8-bit LM head (lm_head_bits: 8) or bits: 8 keeps more",
    "kv_cache": "dtype: int8, or static per-channel key scales (key_scales: channel), keeps more",
    "gqa_regroup": "regrouping fewer heads keeps more",
}


def check_budget(name: str, report: dict[str, Any], budget: float | None,
                 log: Callable[[str], None]) -> None:
    quality = report.get("quality")
    if report.get("quality_skipped"):
        log(f"      {name}: quality not measured: {report['quality_skipped']}")
    elif "quality" in report and quality is None:
        log(f"      {name}: quality not measured (quality.measure is false)")
    if not quality:
        return
    log(f"      {name}: {quality_line(quality)}")
    also = samples_line(quality)
    if also:
        log(f"      {name}: {also}")
    warn_if_drifting(name, quality, log)
    if budget is not None and quality["ppl_increase_pct"] is None:
        log(f"      {name}: no perplexity to hold to the budget of {budget} %")
    elif budget is not None and quality["ppl_increase_pct"] > budget:
        raise QualityBudgetError(
            f"pass {name!r} raised perplexity by {quality['ppl_increase_pct']:.2f} %, over the "
            f"recipe's quality.max_ppl_increase_pct of {budget} % (no artifact written)")


def warn_if_drifting(name: str, quality: dict[str, Any], log: Callable[[str], None]) -> None:
    """Say in words when a pass changes the model's choices often enough to show in text."""
    agreement = quality["top1_agreement"]
    if agreement >= LOW_TOP1_AGREEMENT:
        return
    better = BETTER_CHOICES.get(name, "a less aggressive setting keeps more")
    log(f"      warning: after {name} the model picks its input's top token only "
        f"{100 * agreement:.1f} % of the time: generated text will differ visibly and chat "
        f"answers may lose coherence; {better}")


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
