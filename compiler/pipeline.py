"""The compile pipeline, in one page: load → passes → lower → write the artifact."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.compiler.artifact import staging_directory, write_artifact
from llmopt.compiler.ir import ArchSpec, ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.lower import LoweringOptions, lower_to_onnx
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import spec_summary
from llmopt.passes.quality import QualityProbe
from llmopt.passes.registry import PASSES, load_pass
from llmopt.runtime.manifest import Manifest


class QualityBudgetError(ValueError):
    """A lossy pass cost more than the recipe's quality budget allows."""


@dataclass
class PassContext:
    """What a pass may read besides the IR: the recipe's calibration and quality settings."""

    recipe: Recipe
    log: Callable[[str], None]
    _probe: QualityProbe | None = None

    def quality_probe(self, ir: ModelIR) -> QualityProbe | None:
        """Held-out windows to measure a pass's cost on; None without `quality.eval_text`."""
        quality = self.recipe.quality
        if quality.eval_text is None:
            return None
        if self._probe is None:
            self._probe = QualityProbe.from_text(ir, quality.eval_text, quality.eval_windows,
                                                 quality.eval_seq_len)
        return self._probe


def compile_recipe(recipe: Recipe, out: Path, log: Callable[[str], None] = print) -> Manifest:
    check_pass_order(recipe)
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


def lowering_options(recipe: Recipe, arch: ArchSpec) -> LoweringOptions:
    """How the recipe's target lowers a model (the target, or its draft)."""
    return LoweringOptions(
        operator_set=recipe.target.operator_set,
        weight_dtype=recipe.target.weight_dtype,
        max_position=min(arch.max_position, recipe.runtime.max_context),
        nbits_accuracy_level=recipe.target.nbits_accuracy_level,
        quantized_matmul=None if recipe.target.quantized_matmul == "auto"
        else recipe.target.quantized_matmul,
    )


def run_passes(
    ir: ModelIR, recipe: Recipe, log: Callable[[str], None]
) -> tuple[ModelIR, list[dict[str, Any]]]:
    configs = recipe.pass_configs()
    log(f"[2/3] running {len(configs)} pass(es)")
    return apply_passes(ir, configs, PassContext(recipe=recipe, log=log))


def apply_passes(
    ir: ModelIR, configs: list[tuple[str, Any]], context: PassContext
) -> tuple[ModelIR, list[dict[str, Any]]]:
    """Run (name, validated config) passes in order; the draft pass runs its own with this."""
    reports = []
    for name, config in configs:
        started = time.perf_counter()
        context.log(f"      {name}: {config.model_dump()}")
        result = load_pass(name).run(ir, config, context)
        ir = result.ir
        report = {"name": name, "config": config.model_dump(mode="json"),
                  "seconds": round(time.perf_counter() - started, 3), **result.report}
        reports.append(report)
        check_budget(name, report, context.recipe.quality.max_ppl_increase_pct, context.log)
    return ir, reports


def check_budget(name: str, report: dict[str, Any], budget: float | None,
                 log: Callable[[str], None]) -> None:
    quality = report.get("quality")
    if not quality:
        return
    log(f"      {name}: perplexity {quality['ppl_before']} -> {quality['ppl_after']} "
        f"({quality['ppl_increase_pct']:+.2f} %), KL {quality['kl']}, "
        f"top-1 agreement {100 * quality['top1_agreement']:.1f} %")
    if budget is not None and quality["ppl_increase_pct"] > budget:
        raise QualityBudgetError(
            f"pass {name!r} raised perplexity by {quality['ppl_increase_pct']:.2f} %, over the "
            f"recipe's quality.max_ppl_increase_pct of {budget} % (no artifact written)")


def check_pass_order(recipe: Recipe) -> None:
    """Every pass's requirements are provided by a pass before it, checked before work."""
    provided: set[str] = set()
    for entry in recipe.passes:
        (name,) = entry
        if "draft" in provided:  # it measured acceptance and costs against the final target
            raise ValueError(f"pass {name!r} comes after 'draft', which must be the last pass")
        missing = set(PASSES[name].requires) - provided
        if missing:
            raise ValueError(f"pass {name!r} needs {sorted(missing)} from an earlier pass")
        provided |= set(PASSES[name].provides)
