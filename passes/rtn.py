"""RTN: round-to-nearest group-wise weight quantization — the baseline the calibrated
methods (GPTQ, AWQ) must beat.

Recipe: `- rtn: {bits: 4, group_size: 32, symmetric: false, include_lm_head: false}`
(`lm_head_bits: 8` keeps an included LM head at 8 bits; `format: nf4` the NF4 code book,
`double_quant: true` its absmax values at 8 bits).
"""

from __future__ import annotations

import time

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.quant_format import QuantizedLinear, concat_outputs
from llmopt.compiler.weight_quant import (
    WeightQuantConfig,
    float_weight,
    quantization_report,
    round_to_nearest,
    target_linears,
)


class Config(WeightQuantConfig):
    pass


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    out = ir.copy()
    errors = {}
    for name in target_linears(ir, config):
        w, own = float_weight(ir, name), config.for_linear(name)
        q, errors[name] = quantize_by_rows(w, own)
        out.set_quantized(name, q)
        del w  # one linear at a time: the next read starts from nothing
    report = quantization_report(ir, out, errors, time.perf_counter() - started, context)
    return PassResult(out, report)


ROW_CHUNK = 8192  # rows quantized at once: an embedding-sized head never doubles in memory


def quantize_by_rows(w: torch.Tensor, config: WeightQuantConfig) -> tuple[QuantizedLinear, float]:
    """RTN codes of w [N, K] and their relative error, ROW_CHUNK rows at a time (integer
    rows are quantized independently, so the result is the whole matrix's; a code book's
    double quantization spans rows, so it takes the matrix whole)."""
    chunk = ROW_CHUNK if config.format != "nf4" else w.shape[0]
    parts, error_sq = [], 0.0
    for start in range(0, w.shape[0], chunk):
        rows = w[start:start + chunk]
        q = round_to_nearest(rows, config)
        error_sq += float((rows - q.dequantize()).norm()) ** 2
        parts.append(q)
    q = parts[0] if len(parts) == 1 else concat_outputs(parts)
    return q, error_sq ** 0.5 / float(w.norm())


def relative_error(w, w_hat) -> float:
    """||w - w_hat|| / ||w||: the weight error a linear takes."""
    return float((w - w_hat).norm() / w.norm())
