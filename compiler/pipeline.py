"""The compile pipeline, in one page: load → passes → pair a draft → lower → write."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmopt.compiler.artifact import staging_directory, write_artifact
from llmopt.compiler.draft_pairing import pair_draft
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.lower import lower
from llmopt.compiler.pass_manager import PassContext, apply_passes
from llmopt.compiler.pass_registry import check_order, in_phase
from llmopt.compiler.preflight import check_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import spec_summary
from llmopt.compiler.sample_budget import can_sample, parameter_count
from llmopt.runtime.manifest import Manifest


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
    with scratch_directory(out) as scratch:
        ir.quantized.spill_dir = scratch  # integer weights wait on disk, not in memory
        # Phase 2: rewrite and quantize, in recipe order; then pair a draft with the result.
        context = PassContext(recipe, log)
        ir, reports = run_passes(ir, recipe, log, context)
        for step in in_phase(recipe.passes, "draft_pairing"):
            ir, report = pair_draft(ir, step, context)
            reports.append(report)
        # Phase 3: lower once (a draft model too, with the same operators) and write the
        # artifact atomically.
        log(f"[3/3] lowering to ONNX ({recipe.target.operator_set} operators, "
            f"{recipe.target.weight_dtype} weights) and writing {out}")
        with staging_directory(out) as staging:
            graphs = {"target": lower(ir, recipe, staging / "target.onnx.data")}
            if ir.draft is not None and ir.draft.ir is not None:
                graphs["draft"] = lower(ir.draft.ir, recipe, staging / "draft.onnx.data")
            manifest = write_artifact(staging, ir, graphs, recipe, reports)
    log(f"      done in {time.perf_counter() - started:.1f} s")
    return manifest


@contextmanager
def scratch_directory(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` (same disk) for what passes spill; removed after."""
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.scratch.",
                                     dir=out.resolve().parent) as scratch:
        yield Path(scratch)


def run_passes(ir: ModelIR, recipe: Recipe, log: Callable[[str], None],
               context: PassContext | None = None) -> tuple[ModelIR, list[dict[str, Any]]]:
    """The recipe's passes in order (its draft entry is the next phase's)."""
    log(f"[2/3] running {len(recipe.passes)} pass(es)")
    if recipe.passes:
        sampled = can_sample(parameter_count(ir.arch))
        log(f"      quality of lossy passes: {recipe.quality_source(sampled)}")
    context = context if context is not None else PassContext(recipe, log)
    return apply_passes(ir, in_phase(recipe.passes, "passes"), context)


def check_pass_order(recipe: Recipe) -> None:
    """The registry's constraints between passes, checked before any work starts."""
    check_order([step.name for step in recipe.passes])
