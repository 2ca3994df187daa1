"""Calibration data, and running it through the model one decoder layer at a time.

Sequential calibration (llm-compressor's sequential pipeline): the calibration set's hidden
states are carried from layer to layer through the already-rewritten prefix; a layer's
weights are read from `ir.weights` by name when that layer runs and released after, and a
pass writes its results back per tensor. Memory is bounded by the hidden states of the
calibration set, one layer's weights and one layer's statistics
(`memory_estimate.calibration_bytes`), whatever the model's depth; and each layer sees the
activations of the model as already rewritten below it, which GPTQ and AWQ both want.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from llmopt.compiler import calibration_mix
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.recipe import CalibrationConfig
from llmopt.compiler.reference import LINEARS, ReferenceModel

if TYPE_CHECKING:
    from llmopt.compiler.pass_manager import PassContext

Observer = Callable[[int, str, torch.Tensor], None]


def calibration_windows(ir: ModelIR, config: CalibrationConfig,
                        log: Callable[[str], None] | None = None) -> torch.Tensor:
    """int64 [samples, seq_len]: the calibration set, the model's own samples mixed with
    calibration.text's first windows as `calibration.model_samples` says (calibration_mix)."""
    return calibration_mix.calibration_windows(ir, config, log)


def matmul_dtype(ir: ModelIR, config: CalibrationConfig) -> torch.dtype:
    """The calibration forward's linear dtype: `calibration.precision`, where `auto` is
    bfloat16 when every decoder linear is still the checkpoint's own bfloat16 weight (its
    values then lose nothing held in bfloat16) and the CPU multiplies bfloat16 natively,
    float32 otherwise."""
    if config.precision != "auto":
        return getattr(torch, config.precision)
    if not fast_bfloat16():
        return torch.float32
    source_dtype = getattr(ir.weights, "source_dtype", lambda name: None)
    linears = [f"layers.{layer}.{name}.weight" for layer in range(ir.arch.num_layers)
               for name in LINEARS]
    stored = {source_dtype(name) for name in linears if name in ir.weights}
    return torch.bfloat16 if stored == {"BF16"} else torch.float32


def fast_bfloat16() -> bool:
    """Whether the CPU has bfloat16 dot products (AVX-512 BF16 or AMX): elsewhere torch
    emulates a bfloat16 product, no faster than float32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def calibration_precision(ir: ModelIR, context: PassContext) -> torch.dtype:
    """`matmul_dtype` for a calibrating pass, logged."""
    dtype = matmul_dtype(ir, context.recipe.calibration)
    context.log(f"      calibration linears in {str(dtype).removeprefix('torch.')} "
                f"(calibration.precision: {context.recipe.calibration.precision})")
    return dtype


def symmetric_gram(x: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """XᵀX [K, K] for x [T, K], computing the blocks on and below the diagonal and mirroring
    the rest: the same products as `x.T @ x` in a little over half the work."""
    k = x.shape[1]
    out = torch.empty(k, k, dtype=x.dtype)
    for start in range(0, k, block):
        stop = start + block
        out[start:, start:stop] = x[:, start:].T @ x[:, start:stop]
        out[start:stop, stop:] = out[stop:, start:stop].T
    return out


class LayerwiseRunner:
    """Holds the calibration set's hidden states at the input of the current layer; runs
    the layer's linears in `precision` (`matmul_dtype`)."""

    def __init__(self, ir: ModelIR, windows: torch.Tensor, batch_size: int = 8,
                 precision: torch.dtype = torch.float32):
        self.model = ReferenceModel(ir, windows.shape[1])
        self.model.matmul_dtype = precision
        self.positions = torch.arange(windows.shape[1])
        with torch.no_grad(), self.model.holding(["embed_tokens"]):
            self.hidden = [self.model.embed(batch) for batch in windows.split(batch_size)]
        self.layer = 0

    def run_layer(self, observer: Observer | None = None) -> None:
        """Run the current layer over the calibration set with its current weights (read
        once for the whole set), calling `observer` on every linear's input."""
        self._forward(observer, keep_outputs=False)

    def advance(self) -> None:
        """Move to the next layer, feeding it this layer's (rewritten) outputs."""
        self._forward(None, keep_outputs=True)
        self.layer += 1

    @torch.no_grad()
    def _forward(self, observer: Observer | None, keep_outputs: bool) -> None:
        # Each batch's output replaces its input as it is computed: the set is held once.
        with observing(self.model, observer), self.model.holding_layer(self.layer):
            for i, hidden in enumerate(self.hidden):
                output = self.model.layer_forward(self.layer, hidden, self.positions, None)
                if keep_outputs:
                    self.hidden[i] = output


@contextmanager
def observing(model: ReferenceModel, observer: Observer | None) -> Iterator[None]:
    previous, model.observer = model.observer, observer
    try:
        yield
    finally:
        model.observer = previous


@torch.no_grad()
def residual_streams(ir: ModelIR, windows: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream entering each layer, and leaving the last: num_layers + 1 tensors
    [windows, seq, hidden]."""
    model = ReferenceModel(ir, windows.shape[1])
    positions = torch.arange(windows.shape[1])
    states = [model.embed(windows)]
    for layer in range(ir.arch.num_layers):
        states += model.run_layers(states[-1:], positions, layer, layer + 1)
    return states


@torch.no_grad()
def final_kl_from_layer(model: ReferenceModel, start: int, hidden: torch.Tensor,
                        target: list[torch.Tensor]) -> float:
    """Mean KL(target || model) of the final next-token distributions, running `model` from
    layer `start` on `hidden` [windows, seq, hidden] (what enters that layer unchanged);
    `target` holds each window's log-probabilities."""
    positions = torch.arange(hidden.shape[1])
    kl = 0.0
    final = model.run_layers([h[None] for h in hidden], positions, start)
    with model.holding_head():
        for w, h in enumerate(final):
            logq = torch.log_softmax(model.logits(h), -1)
            kl += float((target[w].exp() * (target[w] - logq)).sum(-1).mean())
    return kl / len(hidden)
