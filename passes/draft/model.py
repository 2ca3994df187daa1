"""Build draft IRs for speculative decoding: a truncated target (`self`), a narrow shallow
model sliced from the target (`tiny`), and another checkpoint mapped onto the target's
token ids (`model`), plus LM-head trimming (FR-Spec: keep the most frequent tokens).

Every draft reads TARGET token ids: its embedding has one row per target id. Its logits
rows map to target ids through a token map (None: the identity).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from llmopt.compiler.ir import ArchSpec, ModelIR


class TokenizerMismatchError(ValueError):
    """The draft's vocabulary is neither the target's nor a subset of it."""


# --- self: the target's first k layers ------------------------------------------------
def truncated(target: ModelIR, num_layers: int) -> ModelIR:
    """The target's first `num_layers` layers + final norm + LM head (tensors shared)."""
    if not 1 <= num_layers < target.arch.num_layers:
        raise ValueError(f"a self draft keeps 1..{target.arch.num_layers - 1} of the target's "
                         f"{target.arch.num_layers} layers, got {num_layers}")

    def keep(name: str) -> bool:
        return not name.startswith("layers.") or int(name.split(".")[1]) < num_layers

    return dataclasses.replace(
        target,
        arch=dataclasses.replace(target.arch, layers=target.arch.layers[:num_layers]),
        weights={n: t for n, t in target.weights.items() if keep(n)},
        quantized={n: q for n, q in target.quantized.items() if keep(n)},
        annotations={"tokens": target.annotations.get("tokens", {})},
        draft=None,
    )


# --- model: another checkpoint, mapped onto the target's token ids ---------------------
def tokenizer_vocab(ir: ModelIR) -> dict[str, int]:
    return ir.text_tokenizer().get_vocab(with_added_tokens=True)


def _unk_id(ir: ModelIR, vocab: dict[str, int]) -> int:
    unk = json.loads(ir.tokenizer_files["tokenizer.json"]).get("model", {}).get("unk_token")
    return vocab.get(unk, 0) if unk else 0


def draft_rows_to_target(target_vocab: dict[str, int], draft_vocab: dict[str, int],
                         target_width: int, draft_width: int) -> torch.Tensor | None:
    """Target id of each draft logits row that names a token; None when the vocabularies
    are identical. Refuses a draft with tokens the target lacks, naming them."""
    if draft_vocab == target_vocab and draft_width == target_width:
        return None
    missing = sorted((i, s) for s, i in draft_vocab.items() if s not in target_vocab)
    if missing:
        raise TokenizerMismatchError(_mismatch_message(target_vocab, draft_vocab, missing))
    rows = sorted(i for i in draft_vocab.values() if i < draft_width)
    id_to_token = {i: s for s, i in draft_vocab.items()}
    return torch.tensor([target_vocab[id_to_token[i]] for i in rows], dtype=torch.int64)


def _mismatch_message(target_vocab: dict[str, int], draft_vocab: dict[str, int],
                      missing: list[tuple[int, str]]) -> str:
    target_tokens = {i: s for s, i in target_vocab.items()}
    draft_tokens = {i: s for s, i in draft_vocab.items()}
    first = next((i for i in sorted(draft_tokens) if target_tokens.get(i) != draft_tokens[i]),
                 None)
    examples = ", ".join(f"{i} {s!r}" for i, s in missing[:3])
    return (f"draft tokenizer is incompatible with the target's: {len(missing)} of "
            f"{len(draft_vocab)} draft tokens are not in the target vocabulary (e.g. {examples}); "
            f"first differing token id {first}: target {target_tokens.get(first)!r}, "
            f"draft {draft_tokens.get(first)!r}")


def map_to_target(draft: ModelIR, target: ModelIR) -> tuple[ModelIR, torch.Tensor | None]:
    """`draft` re-indexed to read target ids, and its logits rows' target ids (None: same
    vocabulary). Target tokens the draft lacks embed as the draft's unk token (or id 0)."""
    target_vocab, draft_vocab = tokenizer_vocab(target), tokenizer_vocab(draft)
    token_map = draft_rows_to_target(target_vocab, draft_vocab, target.arch.vocab_size,
                                     draft.arch.vocab_size)
    if token_map is None:
        return draft, None
    target_tokens = {i: s for s, i in target_vocab.items()}
    unk = _unk_id(draft, draft_vocab)
    source_rows = torch.tensor([draft_vocab.get(target_tokens.get(t, ""), unk)
                                for t in range(target.arch.vocab_size)], dtype=torch.int64)
    draft_rows = torch.tensor(sorted(i for i in draft_vocab.values()
                                     if i < draft.arch.vocab_size), dtype=torch.int64)
    out = with_head_rows(draft, draft_rows)  # the head keeps the draft's own rows
    out.weights["embed_tokens"] = draft.weights["embed_tokens"][source_rows].contiguous()
    out.tokenizer_files = target.tokenizer_files  # it now reads target ids
    return out, token_map


# --- LM-head trimming -------------------------------------------------------------------
def with_head_rows(ir: ModelIR, rows: torch.Tensor) -> ModelIR:
    """A copy whose (untied) LM head keeps only logits rows `rows`, in that order."""
    out = ir.copy()
    out.weights["lm_head.weight"] = ir.lm_head()[rows].contiguous()
    out.quantized.pop("lm_head", None)  # its own passes may quantize the trimmed head
    out.arch = dataclasses.replace(ir.arch, vocab_size=len(rows), tie_word_embeddings=False)
    return out


def frequent_tokens(token_ids: torch.Tensor, count: int, always: tuple[int, ...],
                    vocab_size: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """The `count` most frequent target ids in `token_ids` (ties: lower id), plus `always`,
    sorted; filled up with the lowest unseen ids when the text has fewer distinct tokens.
    Ids in `first` (the target's own outputs: what the draft must predict) rank above
    every other, by their count there."""
    counts = torch.bincount(token_ids.flatten(), minlength=vocab_size).double()
    if first is not None:
        counts += torch.bincount(first.flatten(), minlength=vocab_size).double() * (
            counts.sum() + 1)
    counts[list(always)] = float("inf")
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:count]).values


def trim_head(ir: ModelIR, token_map: torch.Tensor | None,
              keep_ids: torch.Tensor) -> tuple[ModelIR, torch.Tensor]:
    """Keep only the logits rows whose target id is in `keep_ids` (FR-Spec)."""
    current = token_map if token_map is not None else torch.arange(ir.arch.vocab_size)
    rows = torch.nonzero(torch.isin(current, keep_ids)).flatten()
    return with_head_rows(ir, rows), current[rows]


# --- tiny: a narrow, shallow model sliced from the target --------------------------------
@dataclass(frozen=True)
class TinyShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


def residual_basis(target: ModelIR, hidden_states: torch.Tensor, width: int) -> torch.Tensor:
    """P [hidden, width]: orthonormal top principal directions of the residual stream
    (uncentred), so the draft's residual r ≈ Pᵀx keeps most of the target's x."""
    second_moment = hidden_states.T.double() @ hidden_states.double()
    _, vectors = torch.linalg.eigh(second_moment)
    return vectors[:, -width:].flip(1).float().contiguous()


def sliced_tiny(target: ModelIR, shape: TinyShape, basis: torch.Tensor,
                layers: list[int]) -> ModelIR:
    """A `shape` model whose layers start as target layers `layers`, projected onto
    `basis`: norms folded into the linears after them, heads and MLP channels subset.

    The draft's rms over `width` dims of Pᵀx is sqrt(hidden / width) times the target's
    over x, so every folded norm becomes that constant.
    """
    arch, w = target.arch, target.weights
    _check_tiny_shape(arch, shape)
    scale = (arch.hidden_size / shape.hidden_size) ** 0.5
    ones = torch.full((shape.hidden_size,), scale)
    weights = {"embed_tokens": w["embed_tokens"] @ basis, "final_norm": ones.clone(),
               "lm_head.weight": (target.lm_head() * w["final_norm"]) @ basis}
    for new, old in enumerate(layers):
        weights.update(_sliced_layer(target, old, new, shape, basis, ones))
    specs = tuple(dataclasses.replace(arch.layers[old], num_heads=shape.num_heads,
                                      num_kv_heads=shape.num_kv_heads) for old in layers)
    tiny_arch = dataclasses.replace(
        arch, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        layers=specs, tie_word_embeddings=False)
    return ModelIR(arch=tiny_arch, weights={k: v.contiguous() for k, v in weights.items()},
                   source=f"tiny draft of {target.source}",
                   tokenizer_files=target.tokenizer_files,
                   annotations={"tokens": target.annotations.get("tokens", {})})


def _check_tiny_shape(arch: ArchSpec, shape: TinyShape) -> None:
    spec = arch.layers[0]
    groups, tiny_groups = spec.num_heads // spec.num_kv_heads, shape.num_heads // shape.num_kv_heads
    problems = [
        shape.hidden_size > arch.hidden_size and "hidden_size exceeds the target's",
        shape.intermediate_size > arch.intermediate_size
        and "intermediate_size exceeds the target's",
        shape.num_kv_heads > spec.num_kv_heads and "num_kv_heads exceeds the target's",
        shape.num_heads % shape.num_kv_heads and "num_heads is not a multiple of num_kv_heads",
        tiny_groups > groups and f"more than the target's {groups} query heads per KV head",
        shape.num_layers > arch.num_layers and "num_layers exceeds the target's",
    ]
    if any(problems):
        raise ValueError(f"tiny draft shape {shape}: " + "; ".join(p for p in problems if p))


def _sliced_layer(target: ModelIR, old: int, new: int, shape: TinyShape, basis: torch.Tensor,
                  ones: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer `old` of the target as layer `new` of the tiny draft."""
    spec, w = target.arch.layers[old], target.weights
    p, d = f"layers.{old}.", spec.head_dim
    tiny_groups = shape.num_heads // shape.num_kv_heads
    kv_heads = list(range(shape.num_kv_heads))
    groups = spec.num_heads // spec.num_kv_heads
    q_heads = [k * groups + i for k in kv_heads for i in range(tiny_groups)]
    q_rows, kv_rows = _head_rows(q_heads, d), _head_rows(kv_heads, d)
    channels = torch.arange(shape.intermediate_size)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": channels,
            "up_proj": channels}
    out: dict[str, torch.Tensor] = {}
    for name, keep in rows.items():
        norm = w[p + ("attn_norm" if name[0] in "qkv" else "mlp_norm")]
        out[f"{name}.weight"] = (w[f"{p}{name}.weight"][keep] * norm) @ basis
        if f"{p}{name}.bias" in w:
            out[f"{name}.bias"] = w[f"{p}{name}.bias"][keep]
    out["o_proj.weight"] = basis.T @ w[p + "o_proj.weight"][:, q_rows]
    out["down_proj.weight"] = basis.T @ w[p + "down_proj.weight"][:, channels]
    out["attn_norm"], out["mlp_norm"] = ones.clone(), ones.clone()
    for name in ("q_norm", "k_norm"):
        if p + name in w:
            out[name] = w[p + name].clone()
    for name in ("post_attn_norm", "post_mlp_norm"):  # sandwich norms: a mean-scale start
        if p + name in w:
            out[name] = ones * w[p + name].mean()
    return {f"layers.{new}.{k}": v for k, v in out.items()}


def _head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def evenly_spaced(count: int, total: int) -> list[int]:
    """`count` layer indices from 0 to total - 1, first and last included."""
    if count == 1:
        return [0]
    return [round(i * (total - 1) / (count - 1)) for i in range(count)]

