"""Which layers' KV caches suffer most from the pass's dtype, and how much the whole cache
costs: `auto_skip` keeps the N worst layers in `skip_dtype`, `max_kl` as many as it takes.
Measured, not guessed, by the KL of the final next-token distributions to the float model
on a few calibration windows: each layer quantized alone (every other layer's cache kept
in float, running from that layer's cached input), or every layer as the pass stores it."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llmopt.compiler.calibration import final_kl_from_layer, residual_streams
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import ReferenceModel

SENSITIVITY_WINDOWS = 4


class CacheKL:
    """KL(float model || a model whose caches are stored otherwise) on calibration windows;
    the float model's residual streams and final distributions are computed once."""

    @torch.no_grad()
    def __init__(self, float_ir: ModelIR, windows: torch.Tensor):
        self.windows = windows[:SENSITIVITY_WINDOWS]
        self.hidden = residual_streams(float_ir, self.windows)
        reference = ReferenceModel(float_ir, self.windows.shape[1])
        with reference.holding_head():
            self.target = [torch.log_softmax(reference.logits(h[None]), -1)
                           for h in self.hidden[-1]]

    @torch.no_grad()
    def of(self, ir: ModelIR, start: int = 0) -> float:
        """The KL of `ir`, whose layers before `start` store their caches in float."""
        model = ReferenceModel(ir, self.windows.shape[1])
        return round(final_kl_from_layer(model, start, self.hidden[start], self.target), 6)


def layer_sensitivity(float_ir: ModelIR, quantize: Callable[[ModelIR, int], None],
                      layers: list[int], probe: CacheKL,
                      log: Callable[[str], None]) -> dict[int, float]:
    """KL(float || only layer i's cache quantized) per layer in `layers`; `quantize(ir, i)`
    sets layer i of `ir` to the pass's storage, as the pass itself does."""
    sensitivity = {}
    for i in layers:
        started = time.perf_counter()
        alone = float_ir.copy()
        quantize(alone, i)
        sensitivity[i] = probe.of(alone, i)
        log(f"      kv_cache: layer {i} alone: KL {sensitivity[i]:.4g} "
            f"({time.perf_counter() - started:.1f} s)")
    return sensitivity


def fewest_for_kl(kl_with: Callable[[int], float], most: int, max_kl: float,
                  strict: bool = True) -> tuple[int, dict[int, float]]:
    """The fewest n in 0..most whose `kl_with(n)` (the whole cache's KL with the n most
    sensitive layers in skip_dtype) is <= max_kl, by bisection (more such layers cost less),
    and every KL measured on the way; when even `most` does not reach it, raises (`strict`)
    or returns `most`."""
    measured: dict[int, float] = {}

    def kl(n: int) -> float:
        if n not in measured:
            measured[n] = kl_with(n)
        return measured[n]

    if kl(most) > max_kl and not strict:
        return most, measured
    if kl(most) > max_kl:
        raise ValueError(f"kv_cache.max_kl: {max_kl} not reached (KL {kl(most):.4g} with "
                         f"{most} layers in skip_dtype, all that leave one in dtype)")
    low, high = -1, most  # kl(high) <= max_kl; every n <= low is known to exceed it
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if kl(middle) <= max_kl else (middle, high)
    return high, measured
