"""Which layers' KV caches suffer most from the pass's dtype: `auto_skip` keeps the N worst in
`skip_dtype`. Measured, not guessed: each layer is quantized alone (every other layer's cache
kept in float) and scored by the KL of the final next-token distributions to the float model
on a few calibration windows, running from that layer's cached input."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llmopt.compiler.calibration import final_kl_from_layer, residual_streams
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import ReferenceModel

SENSITIVITY_WINDOWS = 4


@torch.no_grad()
def layer_sensitivity(float_ir: ModelIR, quantize: Callable[[ModelIR, int], None],
                      layers: list[int], windows: torch.Tensor,
                      log: Callable[[str], None]) -> dict[int, float]:
    """KL(float || only layer i's cache quantized) per layer in `layers`; `quantize(ir, i)`
    sets layer i of `ir` to the pass's storage, as the pass itself does."""
    windows = windows[:SENSITIVITY_WINDOWS]
    hidden = residual_streams(float_ir, windows)
    reference = ReferenceModel(float_ir, windows.shape[1])
    target = [torch.log_softmax(reference.logits(h[None]), -1) for h in hidden[-1]]
    sensitivity = {}
    for i in layers:
        started = time.perf_counter()
        alone = float_ir.copy()
        quantize(alone, i)
        model = ReferenceModel(alone, windows.shape[1])
        sensitivity[i] = round(final_kl_from_layer(model, i, hidden[i], target), 6)
        log(f"      kv_cache: layer {i} alone: KL {sensitivity[i]:.4g} "
            f"({time.perf_counter() - started:.1f} s)")
    return sensitivity

