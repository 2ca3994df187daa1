"""Pre-quantized Hugging Face checkpoints: AutoAWQ (GEMM), GPTQ (v1, v2),
compressed-tensors `pack-quantized` and bitsandbytes 4-bit (NF4/FP4, read only: see
compiler/nf4.py), read into QuantizedLinear and written back out.

Every format holds the numbers QuantizedLinear holds, w = (q - zero) * scale with unsigned
codes, in int32 words filled low bits first, 32 / bits values each (pf). They differ in
layout; each format's writer and reader sit side by side below so they cannot drift:

  format              codes                       zero points               scales
  AutoAWQ GEMM        qweight [K, N/8]            qzeros [G, N/8]           scales [G, N]
  GPTQ                qweight [K/pf, N] (K-wise)  qzeros [G, N/pf]          scales [G, N]
  compressed-tensors  weight_packed [N, K/pf]     weight_zero_point         weight_scale [N, G]
                                                  [N/pf, G], asymmetric only

AutoAWQ interleaves each word: slot i holds column 8j + AWQ_ORDER[i]. GPTQ v1
(`format: gptq`, AutoGPTQ's) stores zero - 1 and readers add 1 back; v2 (`gptq_v2`,
GPTQModel's) stores the zero itself. compressed-tensors stores signed values q - 2^(bits-1)
and packs them offset back to unsigned, so its words hold our codes and zeros unchanged;
a symmetric scheme has no zero points (zero 2^(bits-1), our convention too).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from llmopt.compiler.architectures import UnsupportedModelError
from llmopt.compiler.nf4 import BNB_TENSORS, check_bnb_config, from_bnb
from llmopt.compiler.quant_format import QuantizedLinear
from llmopt.compiler.weight_store import SourceTensor, index_safetensors

Tensors = dict[str, torch.Tensor]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: word slot -> column
_AWQ_UNORDER = tuple(AWQ_ORDER.index(c) for c in range(8))  # column -> word slot
# A per-channel scheme (GPTQ group_size -1, compressed-tensors "channel") becomes groups of
# this size sharing each row's one scale and zero: MatMulNBits needs a power-of-two block.
PER_CHANNEL_GROUP = 128


# --- int32 words, low bits first ---------------------------------------------------------
def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ints [..., M] -> int32 [..., ceil(M / pf)], the first value lowest."""
    per_word = 32 // bits
    v = values.to(torch.int64)
    v = torch.nn.functional.pad(v, (0, -v.shape[-1] % per_word)).unflatten(-1, (-1, per_word))
    words = (v << (torch.arange(per_word) * bits)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # wrap to signed


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [..., W] -> int64 [..., count]: the inverse of pack_int32."""
    shifts = torch.arange(32 // bits) * bits
    values = (words.to(torch.int64)[..., None] >> shifts) & (2**bits - 1)
    return values.flatten(-2)[..., :count]


def _linear(bits: int, group_size: int, codes: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor) -> QuantizedLinear:
    """QuantizedLinear from codes [N, K] and per-group scales/zeros [N, G] of any dtype."""
    k = codes.shape[1]
    if scales.shape[1] == 1 and k > PER_CHANNEL_GROUP:  # one group per row
        groups = -(-k // PER_CHANNEL_GROUP)
        group_size, scales, zeros = PER_CHANNEL_GROUP, scales.repeat(1, groups), zeros.repeat(
            1, groups)
    elif group_size == -1:
        group_size = k
    zeros = zeros.float()
    symmetric = bool((zeros == 2 ** (bits - 1)).all())
    return QuantizedLinear(bits, group_size, codes.to(torch.uint8), scales.float().contiguous(),
                           zeros.contiguous(), symmetric)


def _integer_zeros(q: QuantizedLinear, name: str, fmt: str) -> torch.Tensor:
    """Zeros [N, G] as int64; a fractional zero (GGUF Q4_1) has no place in `fmt`."""
    if not q.integer_zeros():
        raise ValueError(f"{name}: fractional zero points cannot be stored as {fmt}")
    return q.zeros.to(torch.int64)


def _whole_groups(q: QuantizedLinear, name: str, fmt: str) -> None:
    if q.codebook is not None:
        raise ValueError(f"{name}: code-book (NF4/FP4) weights cannot be stored as {fmt}")
    if q.shape[1] % q.group_size:
        raise ValueError(f"{name}: {fmt} needs the input width {q.shape[1]} to be a multiple "
                         f"of the group size {q.group_size} (choose a group size that divides it)")


def _check_contiguous(g_idx: torch.Tensor | None, k: int, group_size: int, what: str) -> None:
    """QuantizedLinear's groups are contiguous runs of inputs; act-order permutes them."""
    if g_idx is None or group_size == -1:
        return
    if not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group_size):
        raise UnsupportedModelError(
            f"{what} groups are permuted along the input; only contiguous groups are supported "
            "(quantize with static groups or without act-order)")


# --- AutoAWQ, GEMM version ---------------------------------------------------------------
def _awq_interleave(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 8))[..., AWQ_ORDER].flatten(-2)


def to_awq(q: QuantizedLinear, name: str) -> Tensors:
    if q.bits != 4 or q.shape[0] % 8:
        raise ValueError(f"{name}: AutoAWQ GEMM packs 4-bit codes of a multiple of 8 outputs")
    _whole_groups(q, name, "AutoAWQ")
    zeros = _integer_zeros(q, name, "AutoAWQ")
    return {"qweight": pack_int32(_awq_interleave(q.codes.T), 4),
            "qzeros": pack_int32(_awq_interleave(zeros.T), 4),
            "scales": q.scales.T.half().contiguous()}


def from_awq(t: Tensors, bits: int, group_size: int) -> QuantizedLinear:
    n = t["scales"].shape[1]

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [N, R], columns in order
        return unpack_int32(words, 4, n).unflatten(-1, (-1, 8))[..., _AWQ_UNORDER].flatten(-2).T

    return _linear(bits, group_size, unpack(t["qweight"]), t["scales"].T, unpack(t["qzeros"]))


# --- GPTQ, v1 and v2 ---------------------------------------------------------------------
def to_gptq(q: QuantizedLinear, name: str, version: int) -> Tensors:
    n, k = q.shape
    if k % (32 // q.bits) or n % (32 // q.bits):
        raise ValueError(f"{name}: GPTQ packs {32 // q.bits} values a word; {n}x{k} does not fit")
    _whole_groups(q, name, "GPTQ")
    zeros = _integer_zeros(q, name, "GPTQ")
    if version == 1:
        if (zeros == 0).any():  # v1 stores zero - 1: AutoGPTQ cannot hold a zero point of 0
            raise ValueError(f"{name}: GPTQ v1 cannot store a zero point of 0; export gptq_v2")
        zeros = zeros - 1
    return {"qweight": pack_int32(q.codes, q.bits).T.contiguous(),
            "qzeros": pack_int32(zeros.T, q.bits),
            "scales": q.scales.T.half().contiguous(),
            "g_idx": (torch.arange(k) // q.group_size).to(torch.int32)}


def from_gptq(t: Tensors, bits: int, group_size: int, version: int, name: str) -> QuantizedLinear:
    n = t["scales"].shape[1]
    k = t["qweight"].shape[0] * (32 // bits)
    _check_contiguous(t.get("g_idx"), k, group_size, f"{name}: GPTQ act-order (desc_act)")
    zeros = unpack_int32(t["qzeros"], bits, n)
    if version == 1:
        zeros = zeros + 1  # as AutoGPTQ's kernels read it: a stored 2^bits - 1 means 2^bits
        if (zeros >= 2**bits).any():
            raise UnsupportedModelError(f"{name}: GPTQ v1 zero point {2**bits} is out of the "
                                        f"{bits}-bit range")
    codes = unpack_int32(t["qweight"].T.contiguous(), bits, k)
    return _linear(bits, group_size, codes, t["scales"].T, zeros.T)


# --- compressed-tensors, pack-quantized --------------------------------------------------
def to_compressed(q: QuantizedLinear, name: str) -> Tensors:
    _whole_groups(q, name, "compressed-tensors")
    tensors = {"weight_packed": pack_int32(q.codes, q.bits),
               "weight_scale": q.scales.contiguous(),
               "weight_shape": torch.tensor(q.shape, dtype=torch.int64)}
    if not q.symmetric:  # zero points packed along the output dimension
        zeros = _integer_zeros(q, name, "compressed-tensors")
        tensors["weight_zero_point"] = pack_int32(zeros.T, q.bits).T.contiguous()
    return tensors


def from_compressed(t: Tensors, bits: int, group_size: int, symmetric: bool,
                    name: str) -> QuantizedLinear:
    n, k = (int(d) for d in t["weight_shape"])
    _check_contiguous(t.get("weight_g_idx"), k, group_size, f"{name}: actorder: group")
    scales = t["weight_scale"]
    if symmetric:
        zeros = torch.full(scales.shape, 2 ** (bits - 1))
    else:
        zeros = unpack_int32(t["weight_zero_point"].T.contiguous(), bits, n).T
    return _linear(bits, group_size, unpack_int32(t["weight_packed"], bits, k), scales, zeros)


# --- reading a checkpoint ----------------------------------------------------------------
# Per format: the tensor that marks a quantized module, and every tensor such a module has.
_MODULE_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point",
                           "weight_shape", "weight_g_idx"),
    "bitsandbytes": BNB_TENSORS,
}
Reader = Callable[[str, Tensors], QuantizedLinear]


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A pre-quantized checkpoint indexed, no tensor read: its float tensors by HF name,
    and per quantized module (HF name, `model.layers.0.self_attn.q_proj`) a function
    reading that module's integer weights from the files on each call."""

    floats: dict[str, SourceTensor]
    modules: dict[str, Callable[[], QuantizedLinear]]


def read_quantized_checkpoint(location: str, quantization: dict[str, Any]
                              ) -> QuantizedCheckpoint:
    """Index a pre-quantized checkpoint's files: nothing is read until asked for, so a
    compile holds one module's codes at a time, whatever the model's size."""
    method = quantization.get("quant_method")
    if method not in _MODULE_TENSORS:
        raise UnsupportedModelError(
            f"unsupported quantized checkpoint: quant_method {method!r} (supported: "
            f"{', '.join(_MODULE_TENSORS)})")
    read = _READERS[method](quantization)
    directory = _local_directory(location)
    tensors = index_safetensors(sorted(directory.glob("*.safetensors")))
    if not tensors:
        raise UnsupportedModelError(f"pre-quantized checkpoint {directory} has no .safetensors")
    names = _MODULE_TENSORS[method]
    modules = sorted(k.removesuffix(f".{names[0]}") for k in tensors if k.endswith(f".{names[0]}"))
    readers = {}
    for module in modules:
        own = {s: tensors.pop(f"{module}.{s}") for s in names if f"{module}.{s}" in tensors}
        readers[module] = partial(_read_module, read, module, own)
    # Old checkpoints carry RoPE buffers that transformers ignores too.
    floats = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    return QuantizedCheckpoint(floats, readers)


def _read_module(read: Reader, module: str, stored: dict[str, SourceTensor]) -> QuantizedLinear:
    """One module's integer weights, read from its files now."""
    from safetensors import safe_open

    tensors = {}
    for suffix, entry in stored.items():
        with safe_open(str(entry.file), framework="pt") as f:
            tensors[suffix] = f.get_tensor(entry.key)
    return read(module, tensors)


def _awq_reader(config: dict[str, Any]) -> Reader:
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    bits = int(config.get("bits", config.get("w_bit", 4)))
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    if version != "gemm" or bits != 4 or not config.get("zero_point", True):
        raise UnsupportedModelError(
            f"unsupported AWQ checkpoint: version {version!r}, bits {bits}, zero_point "
            f"{config.get('zero_point', True)} (supported: AutoAWQ GEMM, 4 bits, zero points)")
    return lambda name, t: from_awq(t, bits, group_size)


def _gptq_reader(config: dict[str, Any]) -> Reader:
    fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    bits, group_size = int(config.get("bits", 4)), int(config.get("group_size", 128))
    if fmt not in ("gptq", "gptq_v2") or bits not in (4, 8) or config.get("dynamic"):
        raise UnsupportedModelError(
            f"unsupported GPTQ checkpoint: format {fmt!r}, bits {bits}"
            f"{', per-module dynamic overrides' if config.get('dynamic') else ''} "
            "(supported: gptq and gptq_v2 formats, 4 or 8 bits)")
    version = 2 if fmt == "gptq_v2" else 1
    return lambda name, t: from_gptq(t, bits, group_size, version, name)


def _compressed_reader(config: dict[str, Any]) -> Reader:
    if config.get("format") != "pack-quantized" or (
            config.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise UnsupportedModelError(
            f"unsupported compressed-tensors checkpoint: format {config.get('format')!r} "
            "(supported: pack-quantized, no sparsity)")
    groups = [_compressed_scheme(name, group) for name, group in config["config_groups"].items()]

    def read(name: str, t: Tensors) -> QuantizedLinear:
        for targets, (bits, group_size, symmetric) in groups:
            if any(_matches(name, target) for target in targets):
                return from_compressed(t, bits, group_size, symmetric, name)
        raise UnsupportedModelError(f"{name}: no compressed-tensors config group targets it")

    return read


def _compressed_scheme(group_name: str, group: dict[str, Any]
                       ) -> tuple[list[str], tuple[int, int, bool]]:
    weights = group.get("weights") or {}
    strategy, bits = weights.get("strategy"), weights.get("num_bits")
    unsupported = (group.get("input_activations") or group.get("output_activations")
                   or weights.get("type", "int") != "int" or bits not in (4, 8)
                   or strategy not in ("group", "channel")
                   or group.get("format", "pack-quantized") not in (None, "pack-quantized"))
    if unsupported:
        raise UnsupportedModelError(
            f"unsupported compressed-tensors scheme {group_name}: weights {weights}, input "
            f"activations {group.get('input_activations')} (supported: 4- or 8-bit int weights "
            "by group or channel, float activations)")
    group_size = int(weights["group_size"]) if strategy == "group" else -1
    return group["targets"], (int(bits), group_size, bool(weights.get("symmetric", True)))


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' target rule for linears: a class name, `re:` regex, or exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def _bnb_reader(config: dict[str, Any]) -> Reader:
    check_bnb_config(config)
    return lambda name, t: from_bnb(t, name)


_READERS: dict[str, Callable[[dict[str, Any]], Reader]] = {
    "awq": _awq_reader, "gptq": _gptq_reader, "compressed-tensors": _compressed_reader,
    "bitsandbytes": _bnb_reader,
}


def _local_directory(location: str) -> Path:
    if Path(location).is_dir():
        return Path(location)
    from huggingface_hub import snapshot_download  # a hub id: fetch what we read

    return Path(snapshot_download(location, allow_patterns=["*.json", "*.safetensors"]))
