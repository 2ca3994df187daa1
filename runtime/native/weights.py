"""The native step's weights: the plan's tensors mapped from the artifact, as a `Model`."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from llmopt.runtime.native.library import Model, QMatrix


def _chunk_order() -> np.ndarray:
    """Position j of a 64-element chunk holds element chunk_order[j]: the even elements of
    its two 32-blocks, then the odd ones (how kernels.c unpacks a 4-bit chunk)."""
    low = np.arange(64) & 31
    return 32 * (low >> 4) + 2 * (low & 15) + (np.arange(64) >> 5)


class NativeWeights:
    """Every array the C model points at, kept alive with it."""

    def __init__(self, plan: dict[str, Any], data_file: Path, num_threads: int,
                 max_position: int):
        self._data = np.memmap(data_file, dtype=np.uint8, mode="r")
        self._keep: list[np.ndarray] = []
        layers = plan["layers"]
        count = len(layers)
        per_layer = {key: (QMatrix * count)(*(self._matrix(layer[key]) for layer in layers))
                     for key in ("qkv", "o", "gate_up", "down")}
        norms = {key: (ctypes.c_void_p * count)(*(self._pointer(layer[key]) for layer in layers))
                 for key in ("attn_norm", "mlp_norm")}
        self._tables = [*per_layer.values(), *norms.values()]
        embed = plan["embed"]
        cos = self._array(plan["rope"]["cos"])
        self.model = Model(
            layers=count, hidden=plan["hidden"], heads=plan["heads"], kv_heads=plan["kv_heads"],
            head_dim=plan["head_dim"], intermediate=plan["intermediate"], vocab=plan["vocab"],
            max_position=min(max_position, cos.shape[0]), num_threads=num_threads,
            eps=plan["eps"], attn_scale=plan["attn_scale"], rope_cos=self._keep_ptr(cos),
            rope_sin=self._pointer(plan["rope"]["sin"]),
            embed=self._pointer(embed["table"]) if "table" in embed else None,
            embed_codes=self._matrix(embed["codes"]) if "codes" in embed else QMatrix(),
            attn_norm=ctypes.cast(norms["attn_norm"], ctypes.c_void_p),
            mlp_norm=ctypes.cast(norms["mlp_norm"], ctypes.c_void_p),
            final_norm=self._pointer(plan["final_norm"]),
            **{key: ctypes.cast(table, ctypes.c_void_p) for key, table in per_layer.items()},
            head=self._matrix(plan["head"]))

    def _array(self, tensor: dict[str, Any]) -> np.ndarray:
        dtype = np.dtype(tensor["dtype"])
        if "values" in tensor:
            return np.asarray(tensor["values"], dtype=dtype).reshape(tensor["shape"])
        count = tensor["length"] // dtype.itemsize
        return np.frombuffer(self._data, dtype, count, tensor["offset"]).reshape(tensor["shape"])

    def _keep_ptr(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        self._keep.append(array)
        return array.ctypes.data

    def _pointer(self, tensor: dict[str, Any]) -> int:
        return self._keep_ptr(self._array(tensor))

    def _matrix(self, spec: dict[str, Any]) -> QMatrix:
        zeros = self._array(spec["zeros"]) if spec["zeros"] is not None else None
        arrays, matrix = quantized_matrix(self._array(spec["codes"]), self._array(spec["scales"]),
                                          zeros, spec["n"], spec["k"], spec["bits"])
        self._keep += arrays
        return matrix


def quantized_matrix(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, n: int,
                     k: int, bits: int) -> tuple[list[np.ndarray], QMatrix]:
    """A QMatrix over MatMulNBits' inputs (B, scales, packed zero points), with the arrays
    it points at (8-bit codes reordered, zero points one per byte)."""
    codes = codes.reshape(n, -1)
    if bits == 8:  # reordered once, so that 8-bit chunks meet 4-bit activations
        codes = codes[:, :k].reshape(n, k // 64, 64)[:, :, _chunk_order()].reshape(n, k)
    arrays = [np.ascontiguousarray(codes),
              np.ascontiguousarray(scales.reshape(n, -1)[:, : k // 32], dtype=np.float32)]
    if zeros is not None:
        zeros = zeros.reshape(n, -1)
        if bits == 4:  # two per byte, low nibble first
            zeros = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(n, -1)
        arrays.append(np.ascontiguousarray(zeros[:, : k // 32], dtype=np.uint8))
    pointers = [a.ctypes.data for a in arrays]
    return arrays, QMatrix(codes=pointers[0], scales=pointers[1],
                           zeros=pointers[2] if zeros is not None else None,
                           n=n, k=k, bits=bits)
