"""What the compile measures each lossy pass on: the model's own samples always, and held-out
text too when the recipe has one (`quality.eval_text`, else the tail of `calibration.text`
past what calibration reads).

Calibration text and held-out text share a domain: a probe on that text alone cannot see a
pass that learned it. The model's samples are the domain-free check (KL and top-1 there are
unbiased estimates over the model's own distribution, compiler/quality.py); the text gives
the perplexity a budget holds to. The report is the text's measurement, with the samples'
under "on_samples"; with no text, it is the samples' alone, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.quality import QualityProbe, calibration_span

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe

SAMPLE_FIELDS = ("kl", "top1_agreement", "tokens", "source")  # what "on_samples" keeps


@dataclass(frozen=True)
class QualityProbes:
    samples: QualityProbe
    text: QualityProbe | None = None

    @classmethod
    def for_recipe(cls, recipe: Recipe, ir: ModelIR,
                   log: Callable[[str], None] | None = None) -> QualityProbes | None:
        """The recipe's probes (None with `quality.measure: false`)."""
        quality, kind = recipe.quality, recipe.quality_kind()
        if kind == "off":
            return None
        text = None
        if kind == "eval_text":
            text = QualityProbe.from_text(ir, quality.eval_text, quality.eval_windows,
                                          quality.eval_seq_len, log=log)
        elif kind == "calibration_tail":
            text = QualityProbe.held_out(ir, recipe.calibration.text, calibration_span(recipe),
                                         quality.eval_windows, quality.eval_seq_len, log)
        samples = QualityProbe.domain_free(recipe, ir, log)
        return cls(samples, text)

    def compare(self, before: ModelIR, after: ModelIR) -> dict[str, Any]:
        """The text's measurement with the samples' KL and top-1 under "on_samples" (the
        samples' alone without a text)."""
        if self.text is None:
            return self.samples.compare(before, after)
        on_text = self.text.compare(before, after)
        on_samples = self.samples.compare(before, after)
        return {**on_text, "on_samples": {k: on_samples[k] for k in SAMPLE_FIELDS}}


def samples_line(quality: dict[str, Any]) -> str | None:
    """`on the model's own samples: KL k, top-1 agreement t %`, if measured there too."""
    samples = quality.get("on_samples")
    if not samples:
        return None
    return (f"on the model's own samples: KL {samples['kl']}, top-1 agreement "
            f"{100 * samples['top1_agreement']:.1f} % ({samples['source']})")
