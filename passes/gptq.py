"""GPTQ (Frantar et al., 2022): quantize a linear's columns one at a time, pushing each
column's rounding error onto the columns not yet quantized through the inverse Hessian of
the layer-wise objective ||X W^T - X Ŵ^T||², H = 2/n Σ x xᵀ over the calibration tokens.

Recipe: `- gptq: {bits: 4, group_size: 64, symmetric: false, act_order: true, damp: 0.01,
block_size: 128, clip: false, refits: 0, include_lm_head: false}` with a `calibration:` block.

Layer by layer, true-sequentially: the groups of linears that share an input —
[q, k, v] → [o] → [gate, up] → [down] — each take their Hessian from a run of the layer
whose earlier groups are already quantized, then the next layer sees this layer's
quantized outputs. The output stays plain group-wise (`QuantizedLinear`, no g_idx):
with act-order, group scales and zeros are fixed from the float weight in its original
column order ("static groups") before the permuted walk, so a column's group never moves;
without it, each group's come from its error-updated weights as the walk reaches it.
`clip` fixes every group's scale and zero from a clipping ratio searched by the group's
output error under H (AWQ's search) instead. `refits` then alternates a closed-form refit
of each group's scale for the walk's codes (a least-squares solve per row, zeros kept)
with a new walk under the refit scales; each row keeps its lowest tr(ΔW H ΔWᵀ).
The LM head (`include_lm_head`) takes its Hessian from the final norm's outputs.
Reported per linear: `gptq_loss`, the objective Σ err² / [H⁻¹]_jj GPTQ minimizes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from pydantic import Field

from llmopt.compiler.calibration import (
    LayerwiseRunner,
    calibration_precision,
    calibration_windows,
    observing,
    symmetric_gram,
)
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.nf4 import nearest_codes
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.quant_format import (
    QuantizedLinear,
    expand_groups,
    quant_params,
)
from llmopt.compiler.reference import rms_norm
from llmopt.compiler.weight_quant import (
    WeightQuantConfig,
    every_thread,
    intra_op_threads,
    quantization_report,
    quantize_row_slices,
    round_to_nearest,
    search_clip,
    target_linears,
)

# Linears sharing one input, in the order a decoder layer computes them.
SEQUENTIAL_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                     ("down_proj",))
_GATHER_ROWS = 1024  # rows of the permuted H gathered at once: a float64 slice, not all of H


class Config(WeightQuantConfig):
    act_order: bool = True  # walk columns by descending H_ii (static groups: see above)
    damp: float = Field(0.01, gt=0)  # added to H's diagonal, times its mean
    block_size: int = Field(128, gt=0)  # columns per lazy batch update
    # Each group's clipping ratio searched by its output error under H before the walk
    # (AWQ's search): the groups' scales and zeros are then static.
    clip: bool = False
    # Rounds of refitting each group's scale in closed form for the walk's codes, each
    # followed by a walk under the refit scales; every row keeps its best round.
    refits: int = Field(0, ge=0, le=8)

    def needs_calibration_text(self) -> bool:  # reads calibration windows
        return True


class HessianAccumulator:
    """Σ x xᵀ over the tokens seen, in float64; memory is one [K, K] matrix."""

    def __init__(self):
        self.sum: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        products = symmetric_gram(x)  # float32 products, float64 running sum (in place)
        if self.sum is None:
            self.sum = products.double()
        else:
            self.sum += products
        self.tokens += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.sum * (2 / max(1, self.tokens))


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    targets = set(target_linears(ir, config))
    windows = calibration_windows(ir, context.recipe.calibration, context.log)
    out = ir.copy()
    precision = calibration_precision(ir, context)
    # Reads out.weights: each layer sees the quantized linears below it.
    runner = LayerwiseRunner(out, windows, precision=precision)
    errors: dict[str, float] = {}
    losses: dict[str, float] = {}
    for layer in range(ir.arch.num_layers):
        layer_started = time.perf_counter()
        for group in SEQUENTIAL_GROUPS:
            names = [f"layers.{layer}.{p}" for p in group if f"layers.{layer}.{p}" in targets]
            if names:
                hessian = group_hessian(runner, group[0])
                for name in names:
                    _quantize_linear(ir, out, name, hessian, config, errors, losses)
        runner.advance()
        layer_loss = sum(v for n, v in losses.items() if n.startswith(f"layers.{layer}."))
        context.log(f"      gptq layer {layer + 1}/{ir.arch.num_layers}: loss {layer_loss:.4g} "
                    f"({time.perf_counter() - layer_started:.1f} s)")
    if "lm_head" in targets:
        # The head's input: the final norm of the last layer's (quantized) outputs.
        accumulator, final_norm = HessianAccumulator(), out.weights["final_norm"]
        for hidden in runner.hidden:
            accumulator.add(rms_norm(hidden, final_norm, ir.arch.norm_eps))
        _quantize_linear(ir, out, "lm_head", accumulator.hessian(), config, errors, losses)
        context.log(f"      gptq lm_head: loss {losses['lm_head']:.4g}")
    report = quantization_report(ir, out, errors, time.perf_counter() - started, context)
    report["gptq_loss"] = {n: float(f"{v:.5g}") for n, v in losses.items()}
    report["calibration_samples"] = int(windows.shape[0])
    report["calibration_tokens"] = int(windows.numel())
    report["calibration_precision"] = str(precision).removeprefix("torch.")
    return PassResult(out, report)


def group_hessian(runner: LayerwiseRunner, first: str) -> torch.Tensor:
    """H of the input the group shares, from the current layer as it is now. Each batch
    runs only until that input is seen: the rest of the layer would be thrown away."""
    accumulator = HessianAccumulator()

    def observe(_layer: int, name: str, x: torch.Tensor) -> None:
        if name == first:
            accumulator.add(x)
            raise _InputSeen

    with torch.no_grad(), observing(runner.model, observe), runner.model.holding_layer(
            runner.layer):
        for hidden in runner.hidden:
            with contextlib.suppress(_InputSeen):
                runner.model.layer_forward(runner.layer, hidden, runner.positions, None)
    return accumulator.hessian()


class _InputSeen(Exception):
    """Stops a calibration forward once the group's input has been accumulated."""


def _quantize_linear(ir: ModelIR, out: ModelIR, name: str, hessian: torch.Tensor,
                     config: Config, errors: dict, losses: dict) -> None:
    config = config.for_linear(name)
    losses[name] = 0.0

    def quantize(part: torch.Tensor) -> QuantizedLinear:
        clip = search_clip(part, hessian, config) if config.clip else None
        codebook, static = static_groups(part, config, clip)
        q, loss = gptq_quantize(part, hessian, config.bits, config.group_size,
                                config.symmetric, config.act_order, config.damp,
                                config.block_size, codebook, static, config.refits)
        losses[name] += loss
        return q

    q, errors[name] = quantize_row_slices(ir, name, config, quantize)
    out.set_quantized(name, q)


def static_groups(w: torch.Tensor, config: WeightQuantConfig, clip: torch.Tensor | None
                  ) -> tuple[QuantizedLinear | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Fixed group parameters for the walk: a code book's rounding (NF4), or the integer
    scales and zeros of a clipped range; (None, None) lets the walk choose them."""
    if config.format == "nf4":
        return round_to_nearest(w, config, clip), None
    if clip is None:
        return None, None
    return None, quant_params(w, config.bits, config.group_size, config.symmetric, clip)


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, symmetric: bool,
    act_order: bool = True, damp: float = 0.01, block_size: int = 128,
    codebook: QuantizedLinear | None = None,
    static: tuple[torch.Tensor, torch.Tensor] | None = None, refits: int = 0,
) -> tuple[QuantizedLinear, float]:
    """GPTQ of a float weight [N, K] under H [K, K]; returns the codes and the GPTQ
    objective Σ err² / [H⁻¹]_jj summed over columns (err: each column's rounding error).
    `codebook`: w's code-book (NF4) rounding, whose block absmax stay as static scales
    while each column takes its nearest code. `static`: integer scales and zeros [N, G]
    to keep. `refits`: rounds of scale refit and walk (`refit_scales`); the objective is
    then tr(ΔW H ΔWᵀ) of the rows kept."""
    q, loss = _walk(w, hessian, bits, group_size, symmetric, act_order, damp, block_size,
                    codebook, static)
    if refits == 0 or codebook is not None:
        return q, loss
    h = hessian.double()
    best, best_error = q, row_output_error(w, q, h)
    for _ in range(refits):
        for candidate in (refit_scales(w, q, h), None):
            if candidate is None:  # a walk under the refit scales (zeros unchanged)
                candidate, _ = _walk(w, hessian, bits, group_size, symmetric, act_order,
                                     damp, block_size, None, (q.scales, q.zeros))
            q, error = candidate, row_output_error(w, candidate, h)
            better = error < best_error
            best, best_error = _rows_where(better, q, best), torch.where(
                better, error, best_error)
    return best, float(best_error.sum())


def row_output_error(w: torch.Tensor, q: QuantizedLinear, h: torch.Tensor) -> torch.Tensor:
    """Each row's output error d H dᵀ [N] (float64), d = w - ŵ."""
    d = (w.double() - q.dequantize().double())
    return ((d @ h) * d).sum(1)


def _rows_where(mask: torch.Tensor, a: QuantizedLinear, b: QuantizedLinear) -> QuantizedLinear:
    """Rows of `a` where mask [N] holds, else of `b` (rows are independent codes)."""
    pick = lambda x, y: torch.where(mask[:, None], x, y)  # noqa: E731
    return QuantizedLinear(a.bits, a.group_size, pick(a.codes, b.codes),
                           pick(a.scales, b.scales), pick(a.zeros, b.zeros), a.symmetric)


def refit_scales(w: torch.Tensor, q: QuantizedLinear, h: torch.Tensor,
                 rows: int = 256) -> QuantizedLinear:
    """q with each row's group scales s re-solved for its fixed codes c and zeros z:
    the least squares argmin_s (w - ŵ) H (w - ŵ)ᵀ, ŵ_j = s_g(j) (c_j - z_g(j)), one
    [G, G] system a row. A scale that comes out degenerate keeps its old value."""
    n, k = w.shape
    groups, size = q.scales.shape[1], q.group_size
    member = torch.zeros(k, groups, dtype=torch.float64)
    member[torch.arange(k), torch.arange(k) // size] = 1
    u = (q.codes.double() - expand_groups(q.zeros, size, k).double())
    scales = []
    for start in range(0, n, rows):
        u_rows, w_rows = u[start:start + rows], w[start:start + rows].double()
        # hb[r, :, g] = H[:, group g] · u_r[group g]: H times the group's basis vector
        hb = torch.stack([u_rows[:, g * size:(g + 1) * size] @ h[g * size:(g + 1) * size]
                          for g in range(groups)], -1)
        normal = torch.einsum("rj,rjg,jh->rhg", u_rows, hb, member)
        rhs = torch.einsum("rj,rjg->rg", w_rows, hb)
        ridge = 1e-9 * normal.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-30)
        normal = normal + ridge[:, None, None] * torch.eye(groups, dtype=torch.float64)
        scales.append(torch.linalg.solve(normal, rhs).float())
    fitted, old = torch.cat(scales), q.scales
    keep = ~torch.isfinite(fitted) | (fitted.abs() < 1e-10)
    return QuantizedLinear(q.bits, size, q.codes, torch.where(keep, old, fitted), q.zeros,
                           q.symmetric)


def _walk(
    w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, symmetric: bool,
    act_order: bool, damp: float, block_size: int, codebook: QuantizedLinear | None,
    static: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[QuantizedLinear, float]:
    """One GPTQ column walk (gptq_quantize's contract, without refits)."""
    w = w.float().clone()
    n, k = w.shape
    diagonal = hessian.diagonal().double().clone()
    dead = diagonal == 0  # inputs that are always zero: any weight works, take 0
    diagonal[dead] = 1
    w[:, dead] = 0
    levels = 2**bits - 1
    scales, zeros, perm, block_size = _column_order(w, diagonal, bits, group_size, symmetric,
                                                    act_order, block_size, codebook, static)
    dynamic = codebook is None and static is None and not act_order
    # The walk runs on Wᵀ [K, N]: each column of w, each code column and each error-feeding
    # update is then a contiguous row, where column views of w stride through all of memory.
    w_t = w.T[perm]  # a gather: one copy
    del w
    scales_t, zeros_t = scales.T.contiguous(), zeros.T.contiguous()  # [G, N]

    def permuted() -> torch.Tensor:  # one float32 [K, K] copy, gathered by row slices
        h = torch.empty(k, k)
        for start in range(0, k, _GATHER_ROWS):
            rows = perm[start:start + _GATHER_ROWS]
            h[start:start + len(rows)] = hessian[rows[:, None], perm[None, :]]
        h.diagonal().copy_(diagonal[perm])
        return h

    u = _inverse_hessian_factor(permuted, damp)
    group_of = (perm // group_size).tolist()  # original group of each permuted column
    codes_t = torch.zeros(k, n)
    loss = 0.0
    # About ten small ops a column: intra-op threads cost more in fork/join than they save,
    # and collapse when the cores are shared.
    with intra_op_threads(1):
        for b1 in range(0, k, block_size):
            b2 = min(b1 + block_size, k)
            block, u_block = w_t[b1:b2].clone(), u[b1:b2, b1:b2]
            block_err = torch.empty_like(block)
            for i, d in enumerate(u_block.diagonal().tolist()):
                j, g = b1 + i, group_of[b1 + i]
                if dynamic and j % group_size == 0:
                    # Dynamic groups: parameters of the error-updated weights of this group.
                    group_scales, group_zeros = quant_params(
                        block[i:i + group_size].T, bits, group_size, symmetric)
                    scales_t[g], zeros_t[g] = group_scales[:, 0], group_zeros[:, 0]
                col = block[i]
                codes_t[j], rounded = _round_column(col, scales_t[g], zeros_t[g], levels,
                                                    codebook)
                err = (col - rounded).div_(d)
                block[i:].addr_(u_block[i, i:], err, alpha=-1)  # feed the error forward
                block_err[i] = err
            loss += float(block_err.double().pow(2).sum())
            w_t[b2:].addmm_(u[b1:b2, b2:].T, block_err, alpha=-1)  # lazy update after the block
    scales, zeros = scales_t.T.contiguous(), zeros_t.T.contiguous()
    codes = codes_t[torch.argsort(perm)].T.contiguous().to(torch.uint8)
    if codebook is not None:
        return QuantizedLinear(4, group_size, codes, scales, zeros, True,
                               codebook=codebook.codebook), loss
    return QuantizedLinear(bits, group_size, codes, scales, zeros, symmetric), loss


def _column_order(w: torch.Tensor, diagonal: torch.Tensor, bits: int, group_size: int,
                  symmetric: bool, act_order: bool, block_size: int,
                  codebook: QuantizedLinear | None,
                  static: tuple[torch.Tensor, torch.Tensor] | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The starting scales and zeros, the order columns are quantized in, and the block
    size: static parameters under act_order, a code book or given ones, else filled group
    by group."""
    n, k = w.shape
    if codebook is not None or static is not None:
        # static block absmax (double-quantized where asked), or the caller's parameters
        given = (codebook.scales, codebook.zeros) if codebook is not None else static
        scales, zeros = given[0].clone(), given[1].clone()
        perm = torch.argsort(diagonal, descending=True) if act_order else torch.arange(k)
    elif act_order:
        # Static groups: every group's scale and zero from the unpermuted float weight.
        scales, zeros = quant_params(w, bits, group_size, symmetric)
        perm = torch.argsort(diagonal, descending=True)
    else:
        groups = -(-k // group_size)
        scales, zeros = torch.zeros(n, groups), torch.zeros(n, groups)
        perm = torch.arange(k)
        # Blocks hold whole groups, so a group's parameters see all updates before it.
        block_size = max(group_size, block_size // group_size * group_size)
    return scales, zeros, perm, block_size


def _round_column(col: torch.Tensor, s: torch.Tensor, z: torch.Tensor, levels: int,
                  codebook: QuantizedLinear | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A column's codes and the values they stand for: integer (quantize_with's math) or
    the nearest code-book entry under the block's absmax."""
    if codebook is None:
        q = (col / s + z).round_().clamp_(0, levels)
        return q, (q - z) * s
    q = nearest_codes((col / s).clamp(-1, 1), codebook.codebook)
    return q, codebook.codebook[q.long()] * s


def _inverse_hessian_factor(build: Callable[[], torch.Tensor], damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹ (UᵀU = H⁻¹), λ = damp × mean diag(H); λ grows
    tenfold while H is too ill-conditioned to factor. `build()` gives a fresh float32 H,
    which is damped, factored, inverted and factored again in place: one [K, K] matrix in
    all. float32, as GPTQ's reference factors it (the damping keeps H well conditioned),
    on the compile's threads: a few large LAPACK calls that scale with the cores. The
    summed H stays float64."""
    # Column-major (H is symmetric: its transpose view), as LAPACK factors in place.
    h = build().mT
    diagonal = h.diagonal().double()  # a copy: the factorization overwrites h
    mean_diag = diagonal.mean()
    info = torch.empty((), dtype=torch.int32)
    with every_thread():  # also inside AWQ's one-thread rounding
        for attempt in range(4):
            if attempt:
                h = build().mT  # the failed factorization overwrote it
            h.diagonal().copy_(diagonal + damp * 10**attempt * mean_diag)
            torch.linalg.cholesky_ex(h, out=(h, info))
            if info == 0:
                torch.cholesky_inverse(h, out=h)
                torch.linalg.cholesky_ex(h, upper=True, out=(h, info))
                if info == 0 and bool(torch.isfinite(h.diagonal()).all()):
                    return h
    raise ValueError("GPTQ: the Hessian is not positive definite even with 1000x damping")
