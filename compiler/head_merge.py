"""Merging a layer's KV heads into fewer, fitted to the second moment of its input.

Every projection of a layer's attention input x is linear in x̃ = [x, 1] (the 1 carries the
bias), so one matrix Σ = E[x̃ x̃ᵀ] gives the second moments of every query, key and value
head, before and after any merge: no activations are kept.

Keys (RoPE-exact): in the rotate-half convention, dims (p, p + D/2) of a head form rotary
plane p, a complex number k_p rotated by e^{iθ_p t}. The 2×2 maps that commute with every
such rotation are the complex scalars, so a merged key plane k'_p = Σ_i c_i k_{i,p} and a
query plane scaled by a complex a_h stay exact under RoPE, and q·k = Σ_p Re(q_p conj(k_p)).
Per plane we fit k_i ≈ b_i k' (a rank-1 complex fit of the group's keys, each weighted by
the energy of the query heads that read it, so the fit minimizes logit error rather than
key error) and fold conj(b_i) into those query heads. Mean pooling is c_i = 1/r, b_i = 1.

Values (no RoPE): the shared value head is the top-D principal subspace of the group's
stacked value outputs, measured in the metric of the o_proj columns that read them; the
reconstruction folds into o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmopt.compiler.ir import LayerSpec

Method = Literal["mean", "aligned"]
_DAMP = 1e-6  # relative ridge on o_proj Gram matrices and query energies


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention projections, float64, the bias as the last input column."""

    q: torch.Tensor  # [H*D, E+1]
    k: torch.Tensor  # [G*D, E+1]
    v: torch.Tensor  # [G*D, E+1]
    o: torch.Tensor  # [E, H*D]

    @classmethod
    def of_layer(cls, weights: dict[str, torch.Tensor], layer: int) -> AttentionWeights:
        def augmented(name: str) -> torch.Tensor:
            w = weights[f"layers.{layer}.{name}.weight"].double()
            bias = weights.get(f"layers.{layer}.{name}.bias")
            column = torch.zeros(w.shape[0], 1, dtype=w.dtype) if bias is None else (
                bias.double()[:, None])
            return torch.cat([w, column], dim=1)

        o = weights[f"layers.{layer}.o_proj.weight"].double()
        return cls(augmented("q_proj"), augmented("k_proj"), augmented("v_proj"), o)

    def write(self, weights: dict[str, torch.Tensor], layer: int) -> None:
        """Store into `weights` as float32; a bias is written only where there was one."""
        for name, w in (("q_proj", self.q), ("k_proj", self.k), ("v_proj", self.v)):
            weights[f"layers.{layer}.{name}.weight"] = w[:, :-1].float().contiguous()
            if f"layers.{layer}.{name}.bias" in weights:
                weights[f"layers.{layer}.{name}.bias"] = w[:, -1].float().contiguous()
        weights[f"layers.{layer}.o_proj.weight"] = self.o.float().contiguous()


class InputMoments:
    """Σ = Σ_t x̃ x̃ᵀ / n over the tokens seen, float64 [E+1, E+1]."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
        products = x.T @ x
        self.sum = products if self.sum is None else self.sum + products
        self.tokens += x.shape[0]

    def matrix(self) -> torch.Tensor:
        return self.sum / max(1, self.tokens)


def check_regroup(spec: LayerSpec, kv_heads: int, layer: int) -> None:
    """Query heads stay grouped consistently: new KV head j serves old heads j*r..j*r+r-1."""
    if spec.num_kv_heads % kv_heads:
        raise ValueError(f"gqa_regroup: layer {layer} has {spec.num_kv_heads} KV heads, not a "
                         f"multiple of kv_heads {kv_heads}")
    if spec.head_dim % 2:
        raise ValueError(f"gqa_regroup: layer {layer} has odd head_dim {spec.head_dim}")


def merge_heads(w: AttentionWeights, spec: LayerSpec, kv_heads: int,
                sigma: torch.Tensor | None, method: Method) -> AttentionWeights:
    """The layer's projections with `kv_heads` KV heads (`sigma`: the input's second
    moment, which mean pooling does not need)."""
    if method == "mean":
        return AttentionWeights(w.q, _mean_heads(w.k, spec, kv_heads),
                                _mean_heads(w.v, spec, kv_heads), w.o)
    if sigma is None:
        raise ValueError("an aligned merge needs the input moments")
    q, k = _merge_keys(w.q, w.k, spec, kv_heads, sigma)
    v, o = _merge_values(w.v, w.o, spec, kv_heads, sigma)
    return AttentionWeights(q, k, v, o)


def _mean_heads(proj: torch.Tensor, spec: LayerSpec, kv_heads: int) -> torch.Tensor:
    r, d = spec.num_kv_heads // kv_heads, spec.head_dim
    return proj.view(kv_heads, r, d, -1).mean(dim=1).reshape(kv_heads * d, -1)


def _complex_planes(proj: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """[heads, D/2, E+1] complex rows: plane p is dims (p, p + D/2) of each head."""
    rows = proj.view(heads, 2, d // 2, -1)
    return torch.complex(rows[:, 0], rows[:, 1])


def _real_rows(planes: torch.Tensor) -> torch.Tensor:
    """Inverse of `_complex_planes`: [heads * D, E+1]."""
    return torch.stack([planes.real, planes.imag], dim=1).reshape(-1, planes.shape[-1])


def _merge_keys(q: torch.Tensor, k: torch.Tensor, spec: LayerSpec, kv_heads: int,
                sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, g = spec.head_dim, spec.num_kv_heads
    r, per_kv = g // kv_heads, spec.num_heads // g
    qc = _complex_planes(q, spec.num_heads, d)  # [H, P, E+1]
    kc = _complex_planes(k, g, d)  # [G, P, E+1]
    sigma_c = sigma.to(qc.dtype)
    # Query energy E|q_{h,p}|², summed over the query heads reading each old KV head.
    q_energy = torch.einsum("hpe,ef,hpf->hp", qc.conj(), sigma_c, qc).real
    energy = q_energy.view(g, per_kv, -1).sum(1)  # [G, P]
    energy = energy.clamp_min(_DAMP * float(energy.mean()) + 1e-30)
    merged_k, scale = [], torch.empty(g, d // 2, dtype=qc.dtype)
    for j in range(kv_heads):
        heads = slice(j * r, (j + 1) * r)
        rows = kc[heads].transpose(0, 1)  # [P, r, E+1]
        cov = torch.einsum("pie,ef,pjf->pij", rows.conj(), sigma_c, rows)  # E[conj(k_i) k_j]
        root = energy[heads].T.sqrt()  # [P, r]
        weighted = root[:, :, None] * cov * root[:, None, :]
        _, vectors = torch.linalg.eigh(weighted)
        top = vectors[:, :, -1]  # [P, r], unit norm
        coeff = root * top  # k' = Σ_i c_i k_i
        merged_k.append(torch.einsum("pi,pie->pe", coeff.to(rows.dtype), rows))
        scale[heads] = (top / root).T  # k_i ≈ conj(top_i)/root_i k': fold conj(b_i) = top_i/root_i
    q_scale = scale.repeat_interleave(per_kv, dim=0)  # [H, P]
    new_q = _real_rows(qc * q_scale[:, :, None])
    return new_q, _real_rows(torch.stack(merged_k))


def _merge_values(v: torch.Tensor, o: torch.Tensor, spec: LayerSpec, kv_heads: int,
                  sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, g = spec.head_dim, spec.num_kv_heads
    r, per_kv = g // kv_heads, spec.num_heads // g
    o_heads = o.view(o.shape[0], spec.num_heads, d)  # [E, H, D]
    new_v, new_o = [], o.clone().view(o.shape[0], spec.num_heads, d)
    for j in range(kv_heads):
        old = range(j * r, (j + 1) * r)
        roots = [_gram_root(o_heads[:, i * per_kv:(i + 1) * per_kv]) for i in old]
        metric = torch.block_diag(*roots)  # [rD, rD]
        stacked = v[j * r * d:(j + 1) * r * d]  # [rD, E+1]
        _, vectors = torch.linalg.eigh(metric @ stacked @ sigma @ stacked.T @ metric)
        basis = vectors[:, -d:]  # top-D principal directions, [rD, D]
        new_v.append(basis.T @ metric @ stacked)
        back = torch.linalg.solve(metric, basis)  # v_i ≈ back_i v'
        for n, i in enumerate(old):
            heads = slice(i * per_kv, (i + 1) * per_kv)
            new_o[:, heads] = o_heads[:, heads] @ back[n * d:(n + 1) * d]
    return torch.cat(new_v), new_o.reshape(o.shape[0], -1)


def _gram_root(o_heads: torch.Tensor) -> torch.Tensor:
    """(Σ_h O_hᵀ O_h + λI)^½ for the o_proj blocks [E, heads, D] reading one value head."""
    gram = torch.einsum("ehd,ehf->df", o_heads, o_heads)
    gram = gram + _DAMP * float(gram.diagonal().mean()) * torch.eye(gram.shape[0],
                                                                     dtype=gram.dtype)
    values, vectors = torch.linalg.eigh(gram)
    return vectors @ torch.diag(values.clamp_min(0).sqrt()) @ vectors.T
