"""What a lossy pass costs: perplexity, KL divergence and top-1 agreement against the IR
it started from, on held-out text (`quality.eval_text`, else the tail of
`calibration.text`) or, with neither, on text sampled from the input model itself.

Why the model's own samples, not a text shipped in the package: they exist for every
model (any language, code, chat), need no file, and they are exactly the distribution
the KL divergence is defined over — E_p[log p - log q] on text drawn from p: KL and top-1
agreement there are unbiased estimates. Perplexity is not a text perplexity there (on its
own samples a model's perplexity is exp of its entropy, and the increase is about
exp(KL) - 1), so it is labelled as such, and a recipe's perplexity budget needs real text.

A model too large to sample (`compiler/sample_budget.py`) is measured instead on the prose
passages built into the package (`runtime.bench_text`), labelled as such. Every comparison
runs layer-major: both models' layers are read once per probe for all windows, so the
probe costs two reads of the model plus the forward over its few windows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.model_samples import sample
from llmopt.compiler.pass_registry import PASSES
from llmopt.compiler.reference import ReferenceModel
from llmopt.compiler.sample_budget import SAMPLING_MAX_PARAMETERS
from llmopt.compiler.sample_budget import parameter_count as arch_parameters
from llmopt.runtime.texts import windows_of

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe

PROGRESS_EVERY_S = 10.0  # a measurement takes minutes on a real model: say how far it got
# The built-in passages' probe: a fixed token budget, so its compute stays a small share
# of a compile at every size (a forward's cost per parameter grows with its tokens, a
# weight pass's does not; its two streamed reads cost less than one pass's).
PASSAGE_WINDOW, PASSAGE_WINDOWS = 32, 1
# Logits held at once while comparing (each window's log-probabilities wait for the other
# model's): bounds the probe's memory at large vocabularies.
LOGITS_BUDGET_BYTES = 512 << 20
SAMPLES = "samples"  # QualityProbe.kind of the model's own samples
NO_PERPLEXITY = "none: the LM head keeps a subset of the vocabulary"  # `perplexity_on`


@dataclass(frozen=True)
class QualityProbe:
    windows: list[list[int]]  # token windows of held-out text
    log: Callable[[str], None] | None = None  # progress lines for the compile log
    source: str = "eval_text"  # what the windows are, for the report
    kind: str = "text"  # "text", or SAMPLES: perplexity is then not a text perplexity

    @classmethod
    def for_recipe(cls, recipe: Recipe, ir: ModelIR,
                   log: Callable[[str], None] | None = None) -> QualityProbe | None:
        """The recipe's probe: `quality.eval_text`, else the part of `calibration.text`
        past what the passes calibrate on, else samples of `ir`; None with
        `quality.measure: false`."""
        quality, kind = recipe.quality, recipe.quality_kind()
        if kind == "off":
            return None
        if kind == "eval_text":
            return cls.from_text(ir, quality.eval_text, quality.eval_windows,
                                 quality.eval_seq_len, log=log)
        if kind == "calibration_tail":
            probe = cls.held_out(ir, recipe.calibration.text, calibration_span(recipe),
                                 quality.eval_windows, quality.eval_seq_len, log)
            if probe is not None:
                return probe
        return cls.domain_free(recipe, ir, log)

    @classmethod
    def domain_free(cls, recipe: Recipe, ir: ModelIR,
                    log: Callable[[str], None] | None = None) -> QualityProbe:
        """The model's own samples; the built-in passages for a model too large to sample."""
        if parameter_count(ir) > SAMPLING_MAX_PARAMETERS:
            return cls.from_passages(ir, PASSAGE_WINDOWS, log)
        quality = recipe.quality
        return cls.from_samples(ir, quality.sampled_sequences, quality.sampled_tokens,
                                quality.seed, log)

    @classmethod
    def from_passages(cls, ir: ModelIR, windows: int,
                      log: Callable[[str], None] | None = None) -> QualityProbe:
        """Up to `windows` windows of the prose passages built into the package."""
        from llmopt.runtime.texts import PASSAGES

        ids = ir.text_tokenizer().encode("\n\n".join(PASSAGES), add_special_tokens=False).ids
        length = min(PASSAGE_WINDOW, ir.arch.max_position, len(ids))
        chosen = windows_of(ids, length, windows, source="the built-in passages")
        return cls(chosen, log, f"{len(chosen)} windows of {length} tokens of the built-in "
                   f"English passages (the model is too large to sample: set "
                   f"quality.eval_text to measure on your own text)")

    @classmethod
    def from_text(cls, ir: ModelIR, text_file: str | Path, windows: int, seq_len: int,
                  tail: bool = False, log: Callable[[str], None] | None = None) -> QualityProbe:
        """The first `windows` windows of the text; its last ones with `tail`."""
        every = windows_of(ir.text_token_ids(text_file), seq_len, source=str(text_file))
        chosen = every[-windows:] if tail else every[:windows]
        where = "last" if tail else "first"
        return cls(chosen, log, f"the {where} {len(chosen)} windows of {text_file}")

    @classmethod
    def held_out(cls, ir: ModelIR, text_file: str, skip: int, windows: int, seq_len: int,
                 log: Callable[[str], None] | None = None) -> QualityProbe | None:
        """The last `windows` windows of the text after its first `skip` tokens (what
        calibration reads), fewer if fewer fit; None if none does."""
        rest = ir.text_token_ids(text_file)[skip:]
        every = windows_of(rest, seq_len, minimum=0)
        if not every:
            if log is not None:
                log(f"      quality: calibration.text has no {seq_len}-token window past the "
                    f"{skip} tokens calibration reads; measuring on model samples instead")
            return None
        chosen = every[-windows:]
        return cls(chosen, log, f"the last {len(chosen)} windows of {text_file} (held out: "
                                f"calibration reads its first {skip} tokens)")

    @classmethod
    def from_samples(cls, ir: ModelIR, sequences: int, tokens: int, seed: int,
                     log: Callable[[str], None] | None = None) -> QualityProbe:
        tokens = min(tokens, ir.arch.max_position)
        windows = sample(ir, sequences, tokens, seed, log, "quality").tolist()
        return cls(windows, log, f"{sequences} sequences of {tokens} tokens sampled from "
                   f"the input model (seed {seed})", SAMPLES)

    @torch.no_grad()
    def compare(self, before: ModelIR, after: ModelIR) -> dict[str, float | str | None]:
        """Next-token quality of `after` relative to `before`, window by window. A model
        whose LM head keeps a subset of the vocabulary (a draft's, `head_vocab`) has logits
        rows that are not token ids: KL and top-1 compare its rows, and perplexity, which
        needs the text's next token, is not measured."""
        length = len(self.windows[0])
        # A model too large to sample is read in its stored form, a block of rows at a time:
        # a float32 copy of each layer would cost more than the probe's forward.
        stream = parameter_count(before) > SAMPLING_MAX_PARAMETERS
        ref, new = (ReferenceModel(m, length, stream_linears=stream) for m in (before, after))
        nll_before = nll_after = kl = agree = 0.0
        count = 0
        rows_are_ids = True
        progress = _Progress(self.log, len(self.windows), "windows",
                             f"measuring {len(self.windows)} windows of {length} tokens "
                             "(the pass's input and output models)")
        for chunk in self._final_logits(ref, new):
            for window, logp, logq, rows_are_ids in chunk:
                if rows_are_ids:
                    targets = torch.tensor(window[1:])[:, None]
                    nll_before -= logp.gather(1, targets).sum().item()
                    nll_after -= logq.gather(1, targets).sum().item()
                kl += (logp.exp() * (logp - logq)).sum().item()
                agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
                count += len(window) - 1
                progress.done_one()
        quality: dict[str, float | str | None] = {
            "ppl_before": None, "ppl_after": None, "ppl_increase_pct": None,
            "kl": round(kl / count, 5),
            "top1_agreement": round(agree / count, 5),
            "tokens": count,
            "source": self.source,
            "perplexity_on": NO_PERPLEXITY,
        }
        if rows_are_ids:
            ppl_before, ppl_after = math.exp(nll_before / count), math.exp(nll_after / count)
            quality.update(ppl_before=round(ppl_before, 4), ppl_after=round(ppl_after, 4),
                           ppl_increase_pct=round(100 * (ppl_after / ppl_before - 1), 3),
                           perplexity_on="model samples" if self.kind == SAMPLES else "text")
        return quality

    def _final_logits(self, ref: ReferenceModel, new: ReferenceModel) -> Iterator[list]:
        """Chunks of (window, log p, log q, whether logits rows are token ids): both models
        run layer-major over every window (each layer read once), then their heads score a
        few windows at a time (each head read once per chunk)."""
        length = len(self.windows[0])
        positions = torch.arange(length)
        ids = [torch.tensor([window]) for window in self.windows]
        hidden = []
        for model in (ref, new):
            with model.holding_embedding():
                hidden.append([model.embed(i) for i in ids])
        progress = _Progress(self.log, ref.arch.num_layers, "layers")
        for layer in range(ref.arch.num_layers):
            hidden = [m.run_layers(h, positions, layer, layer + 1)
                      for m, h in zip((ref, new), hidden, strict=True)]
            progress.done_one(final=False)
        per_window = 4 * length * ref.arch.vocab_size
        size = max(1, LOGITS_BUDGET_BYTES // per_window)
        for start in range(0, len(ids), size):
            with ref.holding_head():
                rows_are_ids = _rows(ref, "embed_tokens") == _rows(ref, ref.head_name())
                logps = [torch.log_softmax(ref.logits(h)[0, :-1], dim=-1)
                         for h in hidden[0][start:start + size]]
            with new.holding_head():
                logqs = [torch.log_softmax(new.logits(h)[0, :-1], dim=-1)
                         for h in hidden[1][start:start + size]]
            yield [(w, p, q, rows_are_ids) for w, p, q in zip(
                self.windows[start:start + size], logps, logqs, strict=True)]


def _rows(model: ReferenceModel, name: str) -> int:
    return model.ir.weights.shape(name)[0]


def parameter_count(ir: ModelIR) -> int:
    """The model's parameters, from its shapes alone (no weight is read)."""
    return arch_parameters(ir.arch)


def calibration_span(recipe: Recipe) -> int:
    """Tokens at the start of calibration.text that the recipe's passes may read: every
    calibration window, if any pass calibrates (the registry's `calibrates`)."""
    if not any(PASSES[step.name].calibrates for step in recipe.passes):
        return 0
    return recipe.calibration.samples * recipe.calibration.seq_len


class _Progress:
    """`quality: i/n <unit>` lines: at the start, every PROGRESS_EVERY_S, and at the end."""

    def __init__(self, log: Callable[[str], None] | None, total: int, unit: str,
                 opening: str | None = None):
        self.log, self.total, self.unit, self.done = log, total, unit, 0
        self.started = self.last = time.perf_counter()
        if log is not None and opening is not None:
            log(f"      quality: {opening}")

    def done_one(self, final: bool = True) -> None:
        """One more done; `final`: say so when it is the last (else only every few s)."""
        self.done += 1
        now = time.perf_counter()
        if self.log is not None and ((final and self.done == self.total)
                                     or now - self.last >= PROGRESS_EVERY_S):
            self.log(f"      quality: {self.done}/{self.total} {self.unit}, "
                     f"{now - self.started:.0f} s")
            self.last = now
