"""The native step's weights: the plan's tensors mapped from the artifact, as a `Model`."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.native.arena import HugePageArena
from llmopt.runtime.native.codebook import codebook_arrays
from llmopt.runtime.native.library import (
    KVLayout,
    Model,
    QMatrix,
    QRows,
    amx_available,
    default_knobs,
    kernels,
    profile_phases,
)
from llmopt.runtime.native.plan import (
    EmbeddingRows,
    LaneKV,
    LayerPlan,
    NativePlan,
    QuantizedMatrix,
    Tensor,
)

LAYER_MATRICES = ("qkv", "o", "gate_up", "down")  # in the order a layer runs them


class NativeWeights:
    """Every array the C model points at, kept alive with it."""

    def __init__(self, plan: NativePlan, data_file: Path, num_threads: int,
                 max_position: int):
        with data_file.open("rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        self._keep: list[np.ndarray] = []
        self._arena = HugePageArena()  # the repacked matrices, in the order a step reads them
        layers = plan.layers
        count = len(layers)
        matrices = [{key: self._matrix(getattr(layer, key)) for key in LAYER_MATRICES}
                    for layer in layers]
        per_layer = {key: (QMatrix * count)(*(layer[key] for layer in matrices))
                     for key in LAYER_MATRICES}
        norms = {key: self._per_layer(layers, key) for key in ("attn_norm", "mlp_norm")}
        head_norms = {key: self._per_layer(layers, key)  # Qwen3's, of each q and k head
                      for key in ("q_norm", "k_norm")
                      if any(getattr(layer, key) for layer in layers)}
        kv = (KVLayout * count)(*(self._kv_layout(layer.kv, plan.window) for layer in layers))
        self._tables = [*per_layer.values(), *norms.values(), *head_norms.values(), kv]
        embed = plan.embed
        cos = self._array(plan.rope_cos)
        self.model = Model(
            layers=count, hidden=plan.hidden, heads=plan.heads, kv_heads=plan.kv_heads,
            head_dim=plan.head_dim, intermediate=plan.intermediate, vocab=plan.vocab,
            max_position=min(max_position, cos.shape[0]), num_threads=num_threads,
            eps=plan.eps, attn_scale=plan.attn_scale, rope_cos=self._keep_ptr(cos),
            rope_sin=self._pointer(plan.rope_sin),
            embed=self._pointer(embed) if isinstance(embed, Tensor) else None,
            embed_codes=self._rows(embed) if isinstance(embed, EmbeddingRows) else QRows(),
            attn_norm=ctypes.cast(norms["attn_norm"], ctypes.c_void_p),
            mlp_norm=ctypes.cast(norms["mlp_norm"], ctypes.c_void_p),
            final_norm=self._pointer(plan.final_norm),
            **{key: ctypes.cast(table, ctypes.c_void_p) for key, table in per_layer.items()},
            head=self._matrix(plan.head), kv=ctypes.cast(kv, ctypes.c_void_p),
            **{key: ctypes.cast(table, ctypes.c_void_p) for key, table in head_norms.items()},
            knobs=default_knobs())
        self._phase_seconds = np.zeros(len(profile_phases(kernels())))  # the profile's sums
        # The matrices now live repacked in the arena: give back the file pages they were
        # read from (what the model points into, embedding rows and tables, faults back in).
        self._map.madvise(mmap.MADV_DONTNEED)

    def use_amx(self, enabled: bool) -> bool:
        """Lets this model's steps multiply on AMX tiles where the process has them, or never;
        returns whether they now do. Every output is the same either way, bit for bit."""
        self.model.knobs.amx = enabled and amx_available()
        return bool(self.model.knobs.amx)

    def profile(self, on: bool) -> bool:
        """Turns this model's phase profile on (its sums from zero) or off; returns whether it
        was on."""
        was = bool(self.model.knobs.phase_seconds)
        if on:
            self._phase_seconds[:] = 0
        self.model.knobs.phase_seconds = self._phase_seconds.ctypes.data if on else None
        return was

    def profile_seconds(self) -> dict[str, float]:
        """Seconds each phase gathered while the profile was last on."""
        names = profile_phases(kernels())
        return dict(zip(names, self._phase_seconds.tolist(), strict=True))

    def _per_layer(self, layers: tuple[LayerPlan, ...], key: str) -> ctypes.Array:
        """The C table of each layer's `key` tensor (NULL where a layer has none)."""
        tensors = [getattr(layer, key) for layer in layers]
        return (ctypes.c_void_p * len(layers))(
            *(None if tensor is None else self._pointer(tensor) for tensor in tensors))

    def _kv_layout(self, kv: LaneKV | None, window: int | None) -> KVLayout:
        """A layer's lanes: float32 (None), float16, or codes with static scales; the
        sliding window its queries see (None: every key)."""
        if kv is None:
            return KVLayout(bits=32, window=window or 0)
        pointers = {key: None if tensor is None else self._pointer(tensor)
                    for key, tensor in (("key_scale", kv.key_scale),
                                        ("value_scale", kv.value_scale),
                                        ("rotation", kv.rotation))}
        hadamard = kv.rotation is not None and is_sylvester_hadamard(self._array(kv.rotation))
        return KVLayout(bits=kv.bits, hadamard=hadamard, window=window or 0, **pointers)

    def _array(self, tensor: Tensor) -> np.ndarray:
        dtype = np.dtype(tensor.dtype)
        if tensor.values is not None:
            return np.asarray(tensor.values, dtype=dtype).reshape(tensor.shape)
        count = tensor.length // dtype.itemsize
        return np.frombuffer(self._data, dtype, count, tensor.offset).reshape(tensor.shape)

    def _keep_ptr(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        self._keep.append(array)
        return array.ctypes.data

    def _pointer(self, tensor: Tensor) -> int:
        return self._keep_ptr(self._array(tensor))

    def _matrix(self, spec: QuantizedMatrix) -> QMatrix:
        if spec.codebook is not None:  # NF4 / FP4
            arrays, matrix = codebook_matrix(spec, self._array(spec.codes),
                                             self._array(spec.scales), self._arena.place)
            self._keep += arrays
            if spec.bias is not None:
                matrix.bias = self._pointer(spec.bias)
            return matrix
        offsets = None if spec.offsets is None else self._array(spec.offsets)
        arrays, matrix = quantized_matrix(*self._quantized(spec), spec.n, spec.k, spec.bits,
                                          offsets, spec.block, place=self._arena.place)
        self._keep += arrays
        self._release(spec.codes, spec.scales, spec.zeros, spec.offsets)
        if spec.bias is not None:  # the graph adds it to the projection's output
            matrix.bias = self._pointer(spec.bias)
        return matrix

    def _release(self, *tensors: Tensor | None) -> None:
        """Gives back the file pages of tensors now copied into the arena, as each matrix is
        repacked: loading then holds the arena and one matrix's pages, not the whole file
        twice. A page shared with a tensor read in place faults back in from the file."""
        for tensor in tensors:
            if tensor is None or tensor.values is not None or not tensor.length:
                continue
            start = tensor.offset - tensor.offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.length - start)

    def _rows(self, spec: EmbeddingRows) -> QRows:
        """Embedding rows, read in place (zero points one per byte)."""
        codes, scales, zeros = self._quantized(spec)
        n, k, bits, block = spec.n, spec.k, spec.bits, spec.block
        if zeros is not None:
            zeros = self._keep_ptr(_zero_points(zeros, n, bits, cdiv(k, block)))
        return QRows(codes=self._keep_ptr(codes.reshape(n, -1)),
                     scales=self._keep_ptr(scales.reshape(n, -1)[:, : cdiv(k, block)]
                                           .astype(np.float32)),
                     zeros=zeros, n=n, k=k, bits=bits, block=block)

    def _quantized(self, spec: QuantizedMatrix | EmbeddingRows):
        zeros = None if spec.zeros is None else self._array(spec.zeros)
        return self._array(spec.codes), self._array(spec.scales), zeros


def quantized_matrix(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, n: int,
                     k: int, bits: int, offsets: np.ndarray | None = None, block: int = 32,
                     place: Callable[[np.ndarray], np.ndarray] = np.ascontiguousarray
                     ) -> tuple[list[np.ndarray], QMatrix]:
    """A QMatrix over MatMulNBits' inputs in blocks of `block` columns (B, scales, packed
    zero points; `offsets` [K/32, N] the graph's group offsets of fractional zero points),
    with the arrays it points at: rows padded to a multiple of 16 (scale 0), and per group
    of 16 rows and slice of 32 columns, vector m (0..7) holds in lane i row i's codes
    4m .. 4m+3 (4-bit: vector j's low nibbles are vector 2j, its high nibbles vector
    2j + 1); per-row block values (scales, zero points, offsets) as [group, block, 16];
    scales that are all exact float16 values (GGUF's) also as float16, which steps of fewer
    than 8 rows stream instead (half the bytes, the same numbers); `place` puts each array
    where the matrix keeps it (a HugePageArena's place)."""
    if offsets is not None and block != 32:
        raise ValueError(f"fractional zero points come in blocks of 32, not {block}")
    groups, slices, blocks = cdiv(n, 16), k // 32, cdiv(k, block)
    codes = codes.reshape(n, -1)
    if bits == 4:  # unpack MatMulNBits' nibbles: element 2j low, 2j + 1 high
        codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n, -1)
    values = np.zeros((groups * 16, k), np.uint8)
    values[:n] = codes[:, :k]
    # [group, row, slice, vector m, byte q] -> [group, slice, m, row, q]
    values = values.reshape(groups, 16, slices, 8, 4).transpose(0, 2, 3, 1, 4)
    if bits == 4:  # vector pair (2j, 2j + 1) -> one vector of nibbles
        values = values.reshape(groups, slices, 4, 2, 16, 4)
        values = values[:, :, :, 0] | (values[:, :, :, 1] << 4)
    def per_block(rows: np.ndarray, dtype: type) -> np.ndarray:  # [n, blocks] -> interleaved
        padded = np.zeros((groups * 16, blocks), dtype)
        padded[:n] = rows[:, :blocks]
        return np.ascontiguousarray(padded.reshape(groups, 16, blocks).transpose(0, 2, 1))

    blocked_scales = per_block(scales.reshape(n, -1), np.float32)
    arrays = {"codes": place(values), "scales": place(blocked_scales)}
    half = blocked_scales.astype(np.float16)
    if np.array_equal(half.astype(np.float32), blocked_scales):  # GGUF's, for one
        arrays["half_scales"] = place(half)
    if zeros is not None:
        arrays["zeros"] = place(per_block(_zero_points(zeros, n, bits, blocks), np.uint8))
    if offsets is not None:
        arrays["offsets"] = place(per_block(offsets.reshape(-1, n).T, np.float32))
    return list(arrays.values()), QMatrix(n=n, k=k, bits=bits, block=block,
                                          **{key: a.ctypes.data for key, a in arrays.items()})


def codebook_matrix(spec: QuantizedMatrix, packed: np.ndarray, absmax: np.ndarray,
                    place: Callable[[np.ndarray], np.ndarray] = np.ascontiguousarray
                    ) -> tuple[list[np.ndarray], QMatrix]:
    """A QMatrix over MatMulBnb4's inputs: 4-bit codes, a lookup table, zero points of 128
    (runtime/native/codebook.py), with the arrays it points at."""
    codes, scales, zeros, table = codebook_arrays(spec, packed, absmax)
    arrays, matrix = quantized_matrix(codes, scales, None, spec.n, spec.k, 4, None, spec.block,
                                      place)
    zeros, table = place(zeros), place(table)
    matrix.zeros, matrix.lut = zeros.ctypes.data, table.ctypes.data
    return [*arrays, zeros, table], matrix


def _zero_points(zeros: np.ndarray, n: int, bits: int, blocks: int) -> np.ndarray:
    """MatMulNBits' packed zero points [n, ...] -> one per byte [n, blocks]."""
    zeros = zeros.reshape(n, -1)
    if bits == 4:  # two per byte, low nibble first
        zeros = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(n, -1)
    return np.ascontiguousarray(zeros[:, :blocks], dtype=np.uint8)


def is_sylvester_hadamard(rotation: np.ndarray) -> bool:
    """Whether `rotation` is the normalized Sylvester Hadamard matrix of a power-of-two size
    from 16 to 256 (the kv_cache pass's rotation; compiler/kv_cache_format.hadamard builds it,
    but the runtime imports no torch). kernels.c then rotates by the fast transform."""
    size = rotation.shape[0]
    if rotation.shape != (size, size) or size & (size - 1) or not 16 <= size <= 256:
        return False
    signs = np.ones((1, 1))
    while signs.shape[0] < size:  # Sylvester's construction
        signs = np.block([[signs, signs], [signs, -signs]])
    norm = rotation[0, 0]
    return bool(norm > 0 and np.array_equal(rotation, signs * norm))
