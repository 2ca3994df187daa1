"""gguf_weights: keep a GGUF checkpoint's own quantized blocks instead of re-quantizing.

Recipe: `- gguf_weights: {include_lm_head: true}`. The float IR of a GGUF source is
transformers' dequantization of these very blocks, so re-quantizing it to another grid
only adds error; this pass is lossless.

Q4_0, Q4_1 and Q8_0 blocks are kept (`compiler/gguf_blocks.py` decodes them); other
types (F32, F16, K-quants) stay float. Each kept tensor is checked against the
IR's float weight before it replaces it.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmopt.compiler.architectures import GGUF_PERMUTED_QK, gguf_names
from llmopt.compiler.gguf_blocks import (
    DECODERS,
    check_equal,
    field_string,
    permute_rows,
    unpermute_qk_rows,
)
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.weight_quant import float_weight, quantization_report, target_linears


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Off by default, as for the other passes: ONNX Runtime's 8-bit MatMulNBits is fast only
    # at target.nbits_accuracy_level 4 (slower than the float Gemm at level 0).
    include_lm_head: bool = False
    skip: list[str] = Field(default_factory=list)  # glob patterns of IR linear names


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    import gguf

    started = time.perf_counter()
    path = gguf_path(ir.source)
    reader = gguf.GGUFReader(path)
    architecture = field_string(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    names = gguf_names(ir.arch.num_layers, ir.arch.tie_word_embeddings)
    out = ir.copy()
    errors, diffs, kept, left_float = {}, {}, {}, {}
    for linear in target_linears(ir, config):
        tensor = tensors.get(names[linear])
        kind = tensor.tensor_type.name if tensor is not None else "absent"
        if kind not in DECODERS:
            left_float[linear] = kind
            continue
        q = DECODERS[kind](np.asarray(tensor.data))
        if architecture in GGUF_PERMUTED_QK and linear.endswith(("q_proj", "k_proj")):
            layer = ir.arch.layers[int(linear.split(".")[1])]
            heads = layer.num_heads if linear.endswith("q_proj") else layer.num_kv_heads
            q = permute_rows(q, unpermute_qk_rows(q.shape[0], heads))
        w, dequantized = float_weight(ir, linear), q.dequantize()
        diffs[linear] = check_equal(names[linear], dequantized, w)
        errors[linear] = float((dequantized - w).norm() / w.norm())
        kept[kind] = kept.get(kind, 0) + 1
        out.set_quantized(linear, q)
    report = quantization_report(ir, out, errors, time.perf_counter() - started, context,
                                 lossless=True)
    report.update(
        gguf_file=path, architecture=architecture,
        file_tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        kept_quantized=kept, left_float=left_float,
        max_dequant_diff=max(diffs.values(), default=0.0),
    )
    return PassResult(out, report)


def gguf_path(source: str) -> str:
    """The GGUF file an IR was loaded from; any other source is an error."""
    from pathlib import Path

    from llmopt.compiler.loader import resolve_checkpoint

    ref = resolve_checkpoint(source)
    if ref.gguf_file is None:
        raise ValueError(f"pass 'gguf_weights' needs a .gguf checkpoint, but model {source!r} is "
                         f"not one (use rtn/gptq/awq to quantize it)")
    return str(Path(ref.location) / ref.gguf_file)
