"""How a layer's KV cache is stored: the pool tensors, and both halves of the quantizer.

Each side (keys, values) of a layer is stored in one of `KV_DTYPES`. The torch half
(`encode`/`decode`, used by the reference model) and the ONNX half (`emit_encode`/
`emit_decode`, used by the lowering) run the same float32 operations in the same order,
so the reference computes exactly what the graph stores.

Storage, per token and per side, with W = kv_heads * head_dim and G scale groups:
  float32 / float16   `key` [W] in that dtype
  bfloat16            `key` uint16 [W]: the bfloat16 bit pattern of x (round to nearest
                      even; numpy has no bfloat16, so the pool holds the bits)
  int8                `key` int8 [W], symmetric, code = clip(round(x / s), -127, 127)
  fp8_e4m3            `key` uint8 [W]: the float8 e4m3fn bit pattern of clip(x / s, ±448)
  int4                `key` uint8 [W / 2], two codes per byte (element 2i low nibble);
                      dynamic: asymmetric, code = clip(round((x - m) / s), 0, 15)
                      static: symmetric, code = clip(round(x / s), -8, 7) + 8
Dynamic scales (`scales == "token"`) are computed at write time over each token's groups
of `group_size` channels and stored beside the codes: `key_scale` float16 [G] (and
`key_min` float16 [G] for int4). Static scales (`scales == "channel"`) are per-channel
constants calibrated at compile time, held in the IR as `layers.{i}.{side}_cache_scale`
[W] and baked into the graph: nothing but codes is stored.

Keys may also be scaled per channel within each paged block (`scales == "block"`, KIVI:
key outliers live in channels, and a block is a natural group of tokens). A block's keys
[block_size, W] are stored channel-major, [W, block_size], and quantized as W groups of
block_size tokens by the dynamic quantizer above (int4: two tokens a byte), with `scale`
(and `min`) float16 [W] per block. A block is quantized once it is full; until then its
keys are kept in float32 beside the pool, so a query reads the keys of its own block
unrounded and those of earlier blocks through their block's scales (`block_side`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto

from llmopt.compiler.onnx_graph import GraphBuilder

KV_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "int8", "int4")
SCALE_MODES = ("token", "channel", "block")
FLOAT_KV_DTYPES = ("float32", "float16", "bfloat16")
# The largest code magnitude of each quantized dtype: a static scale is amax / this.
CODE_MAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0}
_MIN_SCALE = 1e-6  # keeps an all-zero group's scale finite (and non-zero in float16)
_FP8_MAX = 448.0


@dataclass(frozen=True)
class KVSide:
    """How one side (`key` or `value`) of one layer is stored."""

    name: str  # "key" | "value"
    dtype: str
    width: int  # kv_heads * head_dim
    group_size: int  # channels per dynamic scale group (divides head_dim)
    scales: str = "token"  # "token": dynamic per token group; "channel": static per channel

    @property
    def quantized(self) -> bool:
        return self.dtype not in FLOAT_KV_DTYPES

    @property
    def dynamic(self) -> bool:
        return self.quantized and self.scales == "token"

    @property
    def per_block(self) -> bool:
        return self.quantized and self.scales == "block"

    @property
    def groups(self) -> int:
        return self.width // self.group_size

    @property
    def static_scale_weight(self) -> str:
        return f"{self.name}_cache_scale"  # under "layers.{i}."

    def tensors(self) -> list[dict]:
        """The pool tensors of this side: name, numpy dtype, slot shape."""
        code_dtype = {"int8": "int8", "fp8_e4m3": "uint8", "int4": "uint8",
                      "bfloat16": "uint16"}.get(self.dtype, self.dtype)
        code_width = self.width // 2 if self.dtype == "int4" else self.width
        out = [{"name": self.name, "dtype": code_dtype, "slot_shape": [code_width]}]
        if self.dynamic:
            out.append({"name": f"{self.name}_scale", "dtype": "float16",
                        "slot_shape": [self.groups]})
            if self.dtype == "int4":
                out.append({"name": f"{self.name}_min", "dtype": "float16",
                            "slot_shape": [self.groups]})
        return out


def block_side(side: KVSide, block_size: int) -> KVSide:
    """The dynamic side that quantizes a whole block of `side` at once: one row per block,
    [W * block_size] channel-major, in W groups of `block_size` tokens."""
    return KVSide(side.name, side.dtype, side.width * block_size, block_size, "token")


def fp8_e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bit patterns. The NaN patterns (0x7f, 0xff)
    are never written; they read as 0 so that no stale pool byte can poison attention."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).astype(np.float64)
    value = np.where(exponent == 0, mantissa * 2.0 ** -9,
                     (8 + mantissa) * 2.0 ** (exponent.astype(np.float64) - 10))
    value = np.where(codes & 128, -value, value)
    value[[127, 255]] = 0.0
    return value.astype(np.float32)


def bfloat16_table() -> np.ndarray:
    """float32 value of each of the 65,536 bfloat16 bit patterns (its upper 16 bits). The
    infinity and NaN patterns are never written; they read as 0, like fp8's NaNs."""
    values = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32).copy()
    values[~np.isfinite(values)] = 0.0
    return values


_BF16_MIN_NORMAL = 2.0 ** -126
_BF16_MAX = float(np.float32(3.3895314e38))  # the largest finite bfloat16


# Exponent thresholds: a normal |y| >= 2^k (k = -5..8) has exponent >= k; below 2^-5 the
# exponent is -6 (normal or, under 2^-6, subnormal with the same 2^-9 spacing).
_FP8_THRESHOLDS = np.array([2.0 ** k for k in range(-5, 9)], dtype=np.float32)


def hadamard(size: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix [size, size]: symmetric and orthogonal."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {size}")
    matrix = np.ones((1, 1))
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return (matrix / np.sqrt(size)).astype(np.float32)


# --- torch half (the reference model) --------------------------------------------------
def fake_quantize(x: torch.Tensor, side: KVSide, static_scale: torch.Tensor | None) -> torch.Tensor:
    """What the cache returns for x [..., W]: decode(encode(x))."""
    if side.dtype == "float32":
        return x
    return decode(encode(x, side, static_scale), side, static_scale)


def encode(x: torch.Tensor, side: KVSide, static_scale: torch.Tensor | None
           ) -> dict[str, torch.Tensor]:
    """The pool entries of x [..., W], keyed by tensor name (as `KVSide.tensors`)."""
    if side.dtype == "float16":
        return {side.name: x.half()}
    if side.dtype == "bfloat16":
        return {side.name: _torch_bf16_codes(x)}
    x4 = x.reshape(*x.shape[:-1], side.groups, side.group_size)
    stored, scale, low = _torch_scales(x4, side, static_scale)
    y = (x4 - low) / scale if low is not None else x4 / scale
    if side.dtype == "int8":
        codes = y.round().clamp(-127, 127).to(torch.int8)
    elif side.dtype == "fp8_e4m3":
        codes = _torch_fp8_codes(y.clamp(-_FP8_MAX, _FP8_MAX))
    else:
        nibbles = y.round().clamp(0, 15) if side.dynamic else y.round().clamp(-8, 7) + 8
        pairs = nibbles.reshape(*x.shape[:-1], side.width // 2, 2)
        codes = (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)
    stored[side.name] = codes.reshape(*x.shape[:-1], -1)
    return stored


def decode(stored: dict[str, torch.Tensor], side: KVSide, static_scale: torch.Tensor | None
           ) -> torch.Tensor:
    codes = stored[side.name]
    if side.dtype == "float16":
        return codes.float()
    if side.dtype == "bfloat16":
        return torch.from_numpy(bfloat16_table())[codes.long()]
    lead = codes.shape[:-1]
    if side.dtype == "int8":
        y = codes.float()
    elif side.dtype == "fp8_e4m3":
        y = torch.from_numpy(fp8_e4m3_table())[codes.long()]
    else:
        packed = codes.float()
        high = torch.floor(packed / 16)
        y = torch.stack([packed - 16 * high, high], dim=-1).reshape(*lead, side.width)
        if not side.dynamic:
            y = y - 8
    y4 = y.reshape(*lead, side.groups, side.group_size)
    if side.dynamic:
        scale = stored[f"{side.name}_scale"].float().unsqueeze(-1)
        y4 = y4 * scale
        if side.dtype == "int4":
            y4 = y4 + stored[f"{side.name}_min"].float().unsqueeze(-1)
    else:
        y4 = y4 * static_scale.reshape(side.groups, side.group_size)
    return y4.reshape(*lead, side.width)


def _torch_scales(x4: torch.Tensor, side: KVSide, static_scale: torch.Tensor | None):
    """(tensors to store, scale, low) for x4 [..., G, group]; low is int4's group minimum."""
    if not side.dynamic:
        return {}, static_scale.reshape(side.groups, side.group_size), None
    if side.dtype == "int4":
        low = x4.amin(-1, keepdim=True)
        raw = (x4.amax(-1, keepdim=True) - low) / 15.0
    else:
        low, raw = None, x4.abs().amax(-1, keepdim=True) / CODE_MAX[side.dtype]
    scale = raw.clamp(min=_MIN_SCALE).half()
    stored = {f"{side.name}_scale": scale.squeeze(-1)}
    if low is not None:
        stored[f"{side.name}_min"] = low.half().squeeze(-1)
        low = low.half().float()
    return stored, scale.float(), low


def _torch_fp8_codes(y: torch.Tensor) -> torch.Tensor:
    """e4m3fn bit patterns of y (|y| <= 448), rounding half to even as a float cast does."""
    a = y.abs()
    e_index = (a.unsqueeze(-1) >= torch.from_numpy(_FP8_THRESHOLDS)).float().sum(-1)
    mantissa = (a / torch.pow(2.0, e_index - 9)).round()
    code = 8 * e_index + mantissa + 128 * (y < 0).float()
    return code.to(torch.uint8)


def _torch_bf16_codes(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 bit patterns of x, by the graph's arithmetic (`_graph_bf16_codes`): the
    exponent from a logarithm, corrected by one where the logarithm rounded across a power
    of two, then the 7-bit mantissa rounded half to even (a carry into the exponent is
    simply +128). Magnitudes below the smallest normal are stored as zero."""
    a = x.abs().clamp(max=_BF16_MAX)
    e = torch.floor(torch.log(a.clamp(min=_BF16_MIN_NORMAL)) / float(np.log(2.0)))
    e = e + (a >= torch.pow(2.0, e + 1)).float() - (a < torch.pow(2.0, e)).float()
    mantissa = torch.round((a / torch.pow(2.0, e) - 1.0) * 128.0)
    code = torch.where(a < _BF16_MIN_NORMAL, torch.zeros_like(a), (e + 127.0) * 128.0 + mantissa)
    code = code + 32768.0 * (x < 0).float()
    return code.to(torch.int32).to(torch.uint16)


def block_round_trip(x: torch.Tensor, side: KVSide, block_size: int) -> torch.Tensor:
    """x [..., T, W] as blocks of `block_size` positions from position 0 read it back,
    each quantized per channel over its block (the last, partial block padded by repeating
    its last row: its read-back is never attended to)."""
    length, width = x.shape[-2:]
    pad = -length % block_size
    if pad:
        x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, width)], dim=-2)
    blocks = x.reshape(*x.shape[:-2], -1, block_size, width).transpose(-1, -2)
    rows = blocks.reshape(*blocks.shape[:-2], width * block_size)
    read = fake_quantize(rows, block_side(side, block_size), None)
    read = read.reshape(*blocks.shape).transpose(-1, -2)
    return read.reshape(*x.shape)[..., :length, :]


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] times the Hadamard matrix (per head)."""
    return x @ torch.from_numpy(hadamard(x.shape[-1]))


# --- ONNX half (the lowering) ------------------------------------------------------------
def emit_encode(g: GraphBuilder, x: str, side: KVSide, static_scale: str | None
                ) -> dict[str, str]:
    """Graph values of the pool entries of x [B, S, W], keyed by tensor name."""
    if side.dtype == "float32":
        return {side.name: x}
    if side.dtype == "float16":
        return {side.name: g.op("Cast", [x], to=TensorProto.FLOAT16)}
    if side.dtype == "bfloat16":
        return {side.name: _graph_bf16_codes(g, x)}
    x4 = g.op("Reshape", [x, g.const([0, 0, side.groups, side.group_size])])
    stored, scale, low = _graph_scales(g, x4, side, static_scale)
    y = g.op("Div", [g.op("Sub", [x4, low]) if low else x4, scale], name=f"{side.name}_y")
    if side.dtype == "int8":
        codes = g.op("Cast", [_clip(g, g.op("Round", [y]), -127, 127)], to=TensorProto.INT8)
    elif side.dtype == "fp8_e4m3":
        codes = _graph_fp8_codes(g, _clip(g, y, -_FP8_MAX, _FP8_MAX))
    else:
        codes = _graph_pack_int4(g, y, side)
    stored[side.name] = g.op("Reshape", [codes, g.const([0, 0, -1])])
    return stored


def emit_round_trip(g: GraphBuilder, x: str, side: KVSide, flat_static_scale: str) -> str:
    """x [B, S, W] as the pool will hold it, in float32: what a fused attention that stores
    a step's keys itself must attend to, so that a token's key does not depend on which
    step computed it. Static int8/int4 (flat_static_scale [W]): a rounded value re-encodes
    to the same code."""
    low, high = {"int8": (-127, 127), "int4": (-8, 7)}[side.dtype]
    codes = _clip(g, g.op("Round", [g.op("Div", [x, flat_static_scale])]), low, high)
    return g.op("Mul", [codes, flat_static_scale], name=f"{side.name}_rounded")


def emit_decode(g: GraphBuilder, stored: dict[str, str], side: KVSide,
                static_scale: str | None) -> str:
    """float32 [B, L, W] from the pool entries `stored` (each [B, L, *slot_shape])."""
    codes = stored[side.name]
    if side.dtype == "float32":
        return codes
    if side.dtype == "float16":
        return g.op("Cast", [codes], to=TensorProto.FLOAT)
    if side.dtype == "bfloat16":
        table = g.weight("bfloat16_table", bfloat16_table())
        return g.op("Gather", [table, g.op("Cast", [codes], to=TensorProto.INT32)], axis=0,
                    name=f"{side.name}s_dequant")
    if side.dtype == "int8":
        return _graph_dequantize_int8(g, codes, stored, side, static_scale)
    if side.dtype == "int4":
        return _graph_dequantize_int4(g, codes, stored, side, static_scale)
    table = g.weight("fp8_e4m3_table", fp8_e4m3_table())
    y = g.op("Gather", [table, g.op("Cast", [codes], to=TensorProto.INT64)], axis=0)
    y4 = g.op("Reshape", [y, g.const([0, 0, side.groups, side.group_size])])
    if side.dynamic:
        y4 = g.op("Mul", [y4, _unsqueezed_float(g, stored[f"{side.name}_scale"])])
    else:
        y4 = g.op("Mul", [y4, static_scale])
    return g.op("Reshape", [y4, g.const([0, 0, side.width])], name=f"{side.name}s_dequant")


def _graph_dequantize_int8(g: GraphBuilder, codes: str, stored: dict[str, str], side: KVSide,
                           static_scale: str | None) -> str:
    """codes * scale in one DequantizeLinear (blocked along channels for per-token groups):
    one pass over the gathered codes instead of a Cast and a Mul over float32."""
    if not side.dynamic:
        scale = g.op("Reshape", [static_scale, g.const([-1])])
        return g.op("DequantizeLinear", [codes, scale], axis=2, name=f"{side.name}s_dequant")
    scale = g.op("Cast", [stored[f"{side.name}_scale"]], to=TensorProto.FLOAT)
    return g.op("DequantizeLinear", [codes, scale], axis=2, block_size=side.group_size,
                name=f"{side.name}s_dequant")


def _graph_dequantize_int4(g: GraphBuilder, codes: str, stored: dict[str, str], side: KVSide,
                           static_scale: str | None) -> str:
    """Unpack nibbles with bit operations on uint8, then one DequantizeLinear (+ the group
    minimum for dynamic, asymmetric scales)."""
    low = g.op("BitwiseAnd", [codes, g.const(15, np.uint8)])
    high = g.op("BitShift", [codes, g.const(4, np.uint8)], direction="RIGHT")
    pairs = g.op("Concat", [g.op("Unsqueeze", [n, g.const([-1])]) for n in (low, high)], axis=-1)
    nibbles = g.op("Reshape", [pairs, g.const([0, 0, side.width])])
    if not side.dynamic:
        scale = g.op("Reshape", [static_scale, g.const([-1])])
        zero = g.weight(f"int4_zero_point_{side.width}", np.full(side.width, 8, np.uint8))
        return g.op("DequantizeLinear", [nibbles, scale, zero], axis=2,
                    name=f"{side.name}s_dequant")
    scale = g.op("Cast", [stored[f"{side.name}_scale"]], to=TensorProto.FLOAT)
    y = g.op("DequantizeLinear", [nibbles, scale], axis=2, block_size=side.group_size)
    y4 = g.op("Reshape", [y, g.const([0, 0, side.groups, side.group_size])])
    y4 = g.op("Add", [y4, _unsqueezed_float(g, stored[f"{side.name}_min"])])
    return g.op("Reshape", [y4, g.const([0, 0, side.width])], name=f"{side.name}s_dequant")


def emit_block_encode(g: GraphBuilder, aligned: str, side: KVSide, block_size: int
                      ) -> dict[str, str]:
    """Quantize whole blocks: aligned [B, nb * bs, W] (the step's blocks, in order) -> the
    pool entries of each block, [B, nb, *entry] (read back by `emit_block_decode`)."""
    rows = _block_rows(g, aligned, side.width, block_size)
    return emit_encode(g, rows, block_side(side, block_size), None)


def emit_block_decode(g: GraphBuilder, stored: dict[str, str], side: KVSide,
                      block_size: int) -> str:
    """float32 [B, M * bs, W] from per-block pool entries (each [B, M, *entry])."""
    whole = block_side(side, block_size)
    return _block_positions(g, emit_decode(g, stored, whole, None), side, block_size)


def _block_rows(g: GraphBuilder, x: str, width: int, block_size: int) -> str:
    """[B, nb * bs, W] -> [B, nb, W * bs]: each block channel-major."""
    blocks = g.op("Reshape", [x, g.const([0, -1, block_size, width])])
    return g.op("Reshape", [g.op("Transpose", [blocks], perm=[0, 1, 3, 2]),
                            g.const([0, 0, width * block_size])])


def _block_positions(g: GraphBuilder, rows: str, side: KVSide, block_size: int) -> str:
    """[B, nb, W * bs] channel-major blocks -> [B, nb * bs, W] in position order."""
    blocks = g.op("Reshape", [rows, g.const([0, 0, side.width, block_size])])
    return g.op("Reshape", [g.op("Transpose", [blocks], perm=[0, 1, 3, 2]),
                            g.const([0, -1, side.width])], name=f"{side.name}_blocks_read")


def emit_rotate_heads(g: GraphBuilder, x: str, heads: int, head_dim: int) -> str:
    """x [B, S, heads*head_dim] times the Hadamard matrix per head."""
    per_head = g.op("Reshape", [x, g.const([0, 0, heads, head_dim])])
    matrix = g.weight(f"hadamard_{head_dim}", hadamard(head_dim))
    rotated = g.op("MatMul", [per_head, matrix], name="rotate_heads")
    return g.op("Reshape", [rotated, g.const([0, 0, heads * head_dim])])


def static_scale_initializer(g: GraphBuilder, name: str, scale: torch.Tensor, side: KVSide) -> str:
    """A static per-channel scale as a [G, group] initializer (broadcasts over [B, L, G, group])."""
    array = scale.detach().float().reshape(side.groups, side.group_size).numpy()
    return g.weight(name, array)


def _graph_scales(g: GraphBuilder, x4: str, side: KVSide, static_scale: str | None):
    if not side.dynamic:
        return {}, static_scale, None
    axes = g.const([-1])
    if side.dtype == "int4":
        low = g.op("ReduceMin", [x4, axes], keepdims=1)
        spread = g.op("Sub", [g.op("ReduceMax", [x4, axes], keepdims=1), low])
        raw = g.op("Div", [spread, g.const(15.0, np.float32)])
    else:
        low = None
        amax = g.op("ReduceMax", [g.op("Abs", [x4]), axes], keepdims=1)
        raw = g.op("Div", [amax, g.const(CODE_MAX[side.dtype], np.float32)])
    raw = g.op("Max", [raw, g.const(_MIN_SCALE, np.float32)])
    scale16 = g.op("Cast", [raw], to=TensorProto.FLOAT16)
    stored = {f"{side.name}_scale": g.op("Squeeze", [scale16, axes])}
    scale = g.op("Cast", [scale16], to=TensorProto.FLOAT)
    if low is not None:
        low16 = g.op("Cast", [low], to=TensorProto.FLOAT16)
        stored[f"{side.name}_min"] = g.op("Squeeze", [low16, axes])
        low = g.op("Cast", [low16], to=TensorProto.FLOAT)
    return stored, scale, low


def _graph_fp8_codes(g: GraphBuilder, y: str) -> str:
    a = g.op("Abs", [y])
    above = g.op("GreaterOrEqual", [g.op("Unsqueeze", [a, g.const([-1])]),
                                    g.weight("fp8_e4m3_thresholds", _FP8_THRESHOLDS)])
    e_index = g.op("ReduceSum", [g.op("Cast", [above], to=TensorProto.FLOAT), g.const([-1])],
                   keepdims=0)
    spacing = g.op("Pow", [g.const(2.0, np.float32),
                           g.op("Sub", [e_index, g.const(9.0, np.float32)])])
    mantissa = g.op("Round", [g.op("Div", [a, spacing])])
    negative = g.op("Cast", [g.op("Less", [y, g.const(0.0, np.float32)])], to=TensorProto.FLOAT)
    code = g.op("Add", [g.op("Add", [g.op("Mul", [e_index, g.const(8.0, np.float32)]), mantissa]),
                        g.op("Mul", [negative, g.const(128.0, np.float32)])])
    return g.op("Cast", [code], to=TensorProto.UINT8, name="fp8_codes")


def _graph_bf16_codes(g: GraphBuilder, x: str) -> str:
    """bfloat16 bit patterns of x [B, S, W] as uint16 (`_torch_bf16_codes`, step by step):
    ONNX has no bit cast, so the pattern is built from the exponent and mantissa."""
    def f(value: float) -> str:
        return g.const(value, np.float32)

    two = f(2.0)
    a = g.op("Min", [g.op("Abs", [x]), f(_BF16_MAX)])
    log2 = g.op("Div", [g.op("Log", [g.op("Max", [a, f(_BF16_MIN_NORMAL)])]), f(np.log(2.0))])
    e = g.op("Floor", [log2])
    above = g.op("GreaterOrEqual", [a, g.op("Pow", [two, g.op("Add", [e, f(1.0)])])])
    below = g.op("Less", [a, g.op("Pow", [two, e])])
    e = g.op("Sub", [g.op("Add", [e, g.op("Cast", [above], to=TensorProto.FLOAT)]),
                     g.op("Cast", [below], to=TensorProto.FLOAT)])
    fraction = g.op("Sub", [g.op("Div", [a, g.op("Pow", [two, e])]), f(1.0)])
    mantissa = g.op("Round", [g.op("Mul", [fraction, f(128.0)])])
    code = g.op("Add", [g.op("Mul", [g.op("Add", [e, f(127.0)]), f(128.0)]), mantissa])
    code = g.op("Where", [g.op("Less", [a, f(_BF16_MIN_NORMAL)]), f(0.0), code])
    negative = g.op("Cast", [g.op("Less", [x, f(0.0)])], to=TensorProto.FLOAT)
    code = g.op("Add", [code, g.op("Mul", [negative, f(32768.0)])])
    return g.op("Cast", [g.op("Cast", [code], to=TensorProto.INT32)], to=TensorProto.UINT16,
                name="bf16_codes")


def _graph_pack_int4(g: GraphBuilder, y: str, side: KVSide) -> str:
    rounded = g.op("Round", [y])
    if side.dynamic:
        nibbles = _clip(g, rounded, 0, 15)
    else:
        nibbles = g.op("Add", [_clip(g, rounded, -8, 7), g.const(8.0, np.float32)])
    pairs = g.op("Reshape", [nibbles, g.const([0, 0, side.width // 2, 2])])
    low, high = g.op("Split", [pairs, g.const([1, 1])], axis=-1, outputs=2)
    packed = g.op("Add", [low, g.op("Mul", [high, g.const(16.0, np.float32)])])
    return g.op("Cast", [packed], to=TensorProto.UINT8, name="int4_pack")


def _unsqueezed_float(g: GraphBuilder, scale16: str) -> str:
    return g.op("Unsqueeze", [g.op("Cast", [scale16], to=TensorProto.FLOAT), g.const([-1])])


def _clip(g: GraphBuilder, x: str, low: float, high: float) -> str:
    return g.op("Clip", [x, g.const(low, np.float32), g.const(high, np.float32)])


def half_precision_attention(spec) -> bool:
    """Whether a `LayerSpec`'s attention takes float16 queries and returns float16 (its
    cache is float16): one node type in ONNX Runtime's GroupQueryAttention, which sums in
    float32, as float16 attention kernels do; every layout and the reference round so."""
    return spec.kv_dtype == "float16"


def kv_sides(spec) -> tuple[KVSide, KVSide]:
    """The key and value sides of a `LayerSpec`."""
    width = spec.num_kv_heads * spec.head_dim
    key_group = spec.kv_group_size or spec.head_dim
    value_group = spec.kv_value_group_size or key_group
    return (KVSide("key", spec.kv_dtype, width, key_group, spec.kv_key_scales),
            KVSide("value", spec.kv_dtype, width, value_group, spec.kv_value_scales))
