"""RTN: round-to-nearest group-wise weight quantization — the baseline the calibrated
methods (GPTQ, AWQ) must beat.

Recipe: `- rtn: {bits: 4, group_size: 32, symmetric: false, include_lm_head: false}`
(`lm_head_bits: 8` keeps an included LM head at 8 bits; `format: nf4` the NF4 code book,
`double_quant: true` its absmax values at 8 bits).
"""

from __future__ import annotations

import time

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.weight_quant import (
    WeightQuantConfig,
    quantization_report,
    quantize_row_slices,
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
        own = config.for_linear(name)
        # Rows round independently: a large head is read and rounded a slice at a time.
        q, errors[name] = quantize_row_slices(ir, name, own,
                                              lambda rows, own=own: round_to_nearest(rows, own))
        out.set_quantized(name, q)
    report = quantization_report(ir, out, errors, time.perf_counter() - started, context)
    return PassResult(out, report)
