"""What every weight-quantization pass shares: its config fields and which linears it takes."""

from __future__ import annotations

import contextlib
import fnmatch
import math
import resource
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.nf4 import NF4_CODE, codebook_quantize
from llmopt.compiler.quant_format import (
    QuantizedLinear,
    concat_outputs,
    group_quantize,
    group_view,
    quant_params,
)

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class WeightQuantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128] = 128
    symmetric: bool = False
    # The LM head: unset (None) quantizes it at 8 bits (nf4: its 4-bit code book), as the
    # native step multiplies integer codes only; false keeps it float; true takes
    # `lm_head_bits`, else `bits`. A tied head's codes are the embedding table too.
    include_lm_head: bool | None = None
    # The LM head's own width when included. An 8-bit head beside 4-bit decoder linears
    # keeps most of the head's quality; a 4-bit one reads half the bytes.
    lm_head_bits: Literal[4, 8] | None = None
    skip: list[str] = Field(default_factory=list)  # glob patterns of linear names
    # "int": integer codes with scales and zero points; "nf4": bitsandbytes' NormalFloat
    # code book with one absmax per group (compiler/nf4.py), 4 bits only.
    format: Literal["int", "nf4"] = "int"
    double_quant: bool = False  # nf4: absmax values rounded to 8 bits in blocks of 256

    @model_validator(mode="after")
    def _patterns_are_strings(self) -> WeightQuantConfig:
        if any(not p for p in self.skip):
            raise ValueError("skip patterns must be non-empty")
        if self.lm_head_bits is not None and self.include_lm_head is False:
            raise ValueError("lm_head_bits needs the LM head included (include_lm_head: false)")
        if self.format == "nf4" and 8 in (self.bits, self.lm_head_bits):
            raise ValueError("format nf4 is a 4-bit code book: bits and lm_head_bits must be 4")
        if self.double_quant and self.format != "nf4":
            raise ValueError("double_quant needs format: nf4")
        return self

    def for_linear(self, name: str) -> WeightQuantConfig:
        """This config as it applies to linear `name` (the LM head may take its own bits)."""
        if name == "lm_head" and self.head_bits() != self.bits:
            return self.model_copy(update={"bits": self.head_bits()})
        return self

    @property
    def quantizes_head(self) -> bool:
        """Whether the pass quantizes the LM head (unset: yes)."""
        return self.include_lm_head is not False

    def head_bits(self) -> int:
        """The LM head's width: `lm_head_bits`, else 8 for an unset head, else `bits`."""
        if self.lm_head_bits is not None:
            return self.lm_head_bits
        if self.include_lm_head is None and self.format == "int":
            return 8
        return self.bits


def round_to_nearest(w: torch.Tensor, config: WeightQuantConfig,
                     clip: torch.Tensor | None = None) -> QuantizedLinear:
    """w [N, K] rounded to the nearest codes of `config`'s format (one linear's config);
    `clip` [N, G] shrinks each group's range (AWQ's clipping search)."""
    if config.format == "nf4":
        return codebook_quantize(w, config.group_size, NF4_CODE, config.double_quant, clip)
    return group_quantize(w, config.bits, config.group_size, config.symmetric, clip)


SOURCE_QUANTIZED = "source_quantized"  # annotation: linears the checkpoint held as codes


def target_linears(ir: ModelIR, config: WeightQuantConfig) -> list[str]:
    """Linear names to quantize, in execution order: decoder linears, then the LM head."""
    names = [f"layers.{i}.{p}" for i in range(ir.arch.num_layers) for p in DECODER_LINEARS]
    if config.include_lm_head is not False:  # None: the default, included
        names.append("lm_head")
    chosen = [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in config.skip)]
    # A pre-quantized checkpoint's codes are kept exact: quantizing them again only loses.
    kept = set(ir.annotations.get(SOURCE_QUANTIZED, ()))
    chosen = [n for n in chosen if n not in kept]
    already = [n for n in chosen if n in ir.quantized]
    if already:
        raise ValueError(f"{already[0]} is already quantized; one weight-quantization pass only")
    return chosen


# A linear larger than this in float32 (an embedding-sized head) is quantized in slices of
# rows: rows are independent under a shared Hessian or Gram, and a slice bounds the copies.
ROW_SLICE_BYTES = 512 << 20


def quantize_row_slices(ir: ModelIR, linear: str, config: WeightQuantConfig,
                        quantize: Callable[[torch.Tensor], QuantizedLinear],
                        ) -> tuple[QuantizedLinear, float]:
    """`quantize` applied to a linear's float weight a slice of rows at a time, each slice
    read from the store alone (a head is never whole in float32; a code book's double
    quantization spans rows, so it takes the matrix whole): the codes and their relative
    error ||w - ŵ|| / ||w||."""
    stored = ir.weight_name(linear)
    n, k = ir.weights.shape(stored)
    rows = n if config.format == "nf4" else max(1, ROW_SLICE_BYTES // (4 * k))
    parts, error_sq, norm_sq = [], 0.0, 0.0
    for _, block in ir.weights.row_blocks(stored, rows):
        part = block.float()
        q = quantize(part)
        error_sq += float((part - q.dequantize()).norm()) ** 2
        norm_sq += float(part.norm()) ** 2
        parts.append(q)
    q = parts[0] if len(parts) == 1 else concat_outputs(parts)
    return q, (error_sq / norm_sq) ** 0.5


def float_weight(ir: ModelIR, linear: str):
    """The float weight [out, in] of a linear (the LM head may be the tied embedding)."""
    return ir.weights[ir.weight_name(linear)]


def quantization_report(before: ModelIR, after: ModelIR, errors: dict[str, float],
                        seconds: float, context: Any, lossless: bool = False) -> dict[str, Any]:
    """Per-linear weight error, cost, bytes, and quality against the input IR (not for a
    `lossless` pass, whose weights were checked equal to its input's)."""
    layouts = [after.quantized.layout(n) for n in errors]  # headers only: codes stay on disk
    float_bytes = sum(4 * n * k for _, _, (n, k) in layouts)
    packed_bytes = sum(n * k * bits // 8 + 8 * n * -(-k // group)
                       for bits, group, (n, k) in layouts)
    report = {
        "linears": len(errors),
        "mean_relative_error": round(sum(errors.values()) / max(1, len(errors)), 5),
        "per_layer_relative_error": {n: round(e, 5) for n, e in errors.items()},
        "quantize_seconds": round(seconds, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "weight_bytes": {"float32": float_bytes, "quantized": packed_bytes},
    }
    if not lossless:
        probe = context.quality_probe(before) if context is not None else None
        report["quality"] = probe.compare(before, after) if probe else None
    return report


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run torch on `count` intra-op threads inside the block. The passes' searches and
    column loops are many small ops: on shared cores torch's thread pool costs more in
    fork/join (and collapses under contention) than it saves."""
    previous = torch.get_num_threads()
    _REPLACED_THREADS.append(previous)
    torch.set_num_threads(count)
    try:
        yield
    finally:
        _REPLACED_THREADS.pop()
        torch.set_num_threads(previous)


_REPLACED_THREADS: list[int] = []  # the counts intra_op_threads replaced, outermost first
# Multiply-adds from which one product is worth every thread inside a search held to one.
LARGE_PRODUCT = 1 << 30


# Weight elements from which a search's elementwise passes are worth every thread.
LARGE_SEARCH = 1 << 23


def search_threads(elements: int) -> contextlib.AbstractContextManager:
    """One intra-op thread for a search over `elements` weight elements, unless there are
    enough that each op's fork/join is small against its work (the linears of 1B models
    and up)."""
    return contextlib.nullcontext() if elements >= LARGE_SEARCH else intra_op_threads(1)


def every_thread() -> contextlib.AbstractContextManager:
    """The thread count from before any `intra_op_threads`, for one large operation inside
    a search held to one thread (a large product, a factorization)."""
    if not _REPLACED_THREADS:
        return contextlib.nullcontext()
    return intra_op_threads(_REPLACED_THREADS[0])


CLIP_GRID, MAX_SHRINK = 20, 0.5  # clipping ratios 1, 0.975, ..., 0.525 (AutoAWQ's range)


def search_clip(w: torch.Tensor, gram: torch.Tensor, config: WeightQuantConfig,
                rows: int = 4096) -> torch.Tensor:
    """Clip ratio [N, G] per weight group minimizing that group's output error d Hgg dᵀ
    under round-to-nearest (groups independent: the cross-group terms of H are ignored)."""
    gram = gram.float()
    size, groups = config.group_size, -(-w.shape[1] // config.group_size)
    # Padded columns repeat the edge weight; zero rows of their blocks hide them.
    blocks = torch.zeros(groups, size, size)
    for g in range(groups):
        block = gram[g * size:(g + 1) * size, g * size:(g + 1) * size]
        blocks[g, :len(block), :len(block)] = block
    chosen = []
    for w_rows in w.split(rows):
        best_error = torch.full((len(w_rows), groups), math.inf)
        best = torch.ones(len(w_rows), groups)
        for step in range(CLIP_GRID):
            ratio = torch.full_like(best, 1 - MAX_SHRINK * step / CLIP_GRID)
            d = group_view(w_rows - fake_quant(w_rows, config, ratio), size).transpose(0, 1)
            error = ((d @ blocks) * d).sum(-1).T  # [N, G]
            better = error < best_error
            best_error, best = torch.where(better, error, best_error), torch.where(
                better, ratio, best)
        chosen.append(best)
    return torch.cat(chosen)


def fake_quant(w: torch.Tensor, config: WeightQuantConfig,
               clip: torch.Tensor | None = None) -> torch.Tensor:
    """`group_quantize(w, ...).dequantize()`, computed in the group view: the same numbers
    without materializing codes or expanding scales (the searches call this 800 times a layer)."""
    if config.format == "nf4":
        return round_to_nearest(w, config, clip).dequantize()
    scales, zeros = quant_params(w, config.bits, config.group_size, config.symmetric, clip)
    scales, zeros = scales[..., None], zeros[..., None]
    codes = (group_view(w, config.group_size) / scales + zeros).round()
    return ((codes.clamp(0, 2**config.bits - 1) - zeros) * scales).flatten(1)[:, : w.shape[1]]


def output_error(d: torch.Tensor, gram: torch.Tensor) -> float:
    """Mean over tokens of ||x dᵀ||², with gram = mean xᵀx; the product d·gram in gram's
    dtype, summed in float32."""
    large = d.numel() * gram.shape[1] >= LARGE_PRODUCT
    with every_thread() if large else contextlib.nullcontext():
        return float(((d.to(gram.dtype) @ gram).float() * d).sum())
