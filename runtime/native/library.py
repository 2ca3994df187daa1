"""The compiled kernels (`_kernels*.so`, built from kernels.c at install) through ctypes."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import Any

from llmopt.runtime.manifest import GraphSpec, KVCacheSpec
from llmopt.runtime.native.plan import LaneKV, Unsupported, read_plan

c_ptr, c_i32, c_f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class QMatrix(ctypes.Structure):
    """kernels.c's QMatrix: codes, per-block scales and zero points of w [n, k] (blocks of
    `block` columns), sixteen rows interleaved (runtime/native/weights.py)."""

    _fields_ = [("codes", c_ptr), ("scales", c_ptr), ("zeros", c_ptr), ("offsets", c_ptr),
                ("n", c_i32), ("k", c_i32), ("bits", c_i32), ("block", c_i32),
                ("half_scales", c_ptr), ("bias", c_ptr), ("lut", c_ptr)]


class QRows(ctypes.Structure):
    """kernels.c's QRows: QMatrix's fields up to `block`, rows in MatMulNBits' layout
    (embedding rows)."""

    _fields_ = QMatrix._fields_[:8]


class KVLayout(ctypes.Structure):
    """kernels.c's KVLayout: how one layer's lanes hold keys and values (32: float32; 16:
    float16; 8/4: codes with static per-channel scales), and the rotation of queries and
    keys, if any (hadamard: it is the Sylvester Hadamard matrix, run as the fast transform);
    a sliding window (0: none)."""

    _fields_ = [("bits", c_i32), ("key_scale", c_ptr), ("value_scale", c_ptr),
                ("rotation", c_ptr), ("hadamard", c_i32), ("window", c_i32)]


class Knobs(ctypes.Structure):
    """kernels.c's Knobs: one model's settings (AMX tiles, row chunks, the phase profile's
    sums), which move speed only; default_knobs() gives a new model's."""

    _fields_ = [("amx", c_i32), ("amx_min_rows", c_i32), ("layer_rows", c_i32),
                ("split_rows", c_i32), ("phase_seconds", c_ptr)]


class Model(ctypes.Structure):
    """kernels.c's Model: shapes, pointers to every weight (arrays of L per layer), and the
    model's knobs."""

    _fields_ = [("layers", c_i32), ("hidden", c_i32), ("heads", c_i32), ("kv_heads", c_i32),
                ("head_dim", c_i32), ("intermediate", c_i32), ("vocab", c_i32),
                ("max_position", c_i32), ("num_threads", c_i32), ("eps", c_f32),
                ("attn_scale", c_f32), ("rope_cos", c_ptr), ("rope_sin", c_ptr),
                ("embed", c_ptr), ("embed_codes", QRows), ("attn_norm", c_ptr),
                ("mlp_norm", c_ptr), ("final_norm", c_ptr), ("qkv", c_ptr), ("o", c_ptr),
                ("gate_up", c_ptr), ("down", c_ptr), ("head", QMatrix), ("kv", c_ptr),
                ("q_norm", c_ptr), ("k_norm", c_ptr), ("knobs", Knobs)]


# kernels.c's exported functions: (return type, argument types)
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "llmopt_native_supported": (ctypes.c_int, []),
    "llmopt_forward": (ctypes.c_int, [ctypes.POINTER(Model), c_i32, c_ptr, c_ptr, c_ptr, c_ptr,
                                      c_ptr, c_ptr, c_ptr, c_i32, c_i32, c_ptr, c_ptr]),
    "llmopt_forward_scored": (ctypes.c_int, [ctypes.POINTER(Model), c_i32, c_ptr, c_ptr, c_ptr,
                                             c_ptr, c_ptr, c_ptr, c_ptr, c_i32, c_i32, c_ptr,
                                             c_ptr, c_ptr]),
    "llmopt_attention_scored": (ctypes.c_int, [ctypes.POINTER(KVLayout), c_ptr, c_i32, c_i32,
                                               c_ptr, c_ptr, c_i32, c_i32, c_f32, c_ptr, c_ptr,
                                               c_ptr]),
    "llmopt_linear": (ctypes.c_int, [ctypes.POINTER(QMatrix), c_ptr, c_i32, c_ptr, c_i32,
                                     ctypes.POINTER(Knobs)]),
    "llmopt_attention": (ctypes.c_int, [ctypes.POINTER(KVLayout), c_ptr, c_i32, c_i32, c_ptr,
                                        c_ptr, c_i32, c_i32, c_f32, c_ptr, c_ptr]),
    "llmopt_native_amx_available": (ctypes.c_int, []),
    "llmopt_native_knobs": (None, [ctypes.POINTER(Knobs)]),
    "llmopt_native_profile_name": (ctypes.c_char_p, [ctypes.c_int]),
    "llmopt_native_layout": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                            ctypes.POINTER(ctypes.c_char_p),
                                            ctypes.POINTER(ctypes.c_int64),
                                            ctypes.POINTER(ctypes.c_int64)]),
}


def declare_signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with ctypes signatures for each of kernels.c's functions it has (an older build,
    loaded beside this one by benchmarks/native_kernels_ab.py, may lack newer ones)."""
    for name, (restype, argtypes) in _SIGNATURES.items():
        if hasattr(lib, name):
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
    return lib


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The kernels library, or None when this install has none (built without a compiler)."""
    spec = importlib.util.find_spec("llmopt.runtime.native._kernels")
    if spec is None or spec.origin is None:
        return None
    return declare_signatures(ctypes.CDLL(spec.origin))


def profile_phases(lib: ctypes.CDLL) -> list[str]:
    """The phases kernels.c's step profile times (a model's knobs.phase_seconds), in order."""
    names: list[str] = []
    while (name := lib.llmopt_native_profile_name(len(names))) is not None:
        names.append(name.decode())
    return names


AMX_VARIABLE = "LLMOPT_NATIVE_AMX"  # "0": new models never use AMX tiles


@functools.cache
def amx_available() -> bool:
    """Whether this process may multiply on AMX int8 tiles (the CPU has them and the kernel
    grants their state); False without the kernels."""
    lib = kernels()
    return bool(lib is not None and lib.llmopt_native_supported()
                and lib.llmopt_native_amx_available())


def default_knobs() -> Knobs:
    """A new model's knobs: kernels.c's defaults, AMX tiles where the process has them
    unless LLMOPT_NATIVE_AMX=0. Every output is the same either way, bit for bit."""
    knobs = Knobs()
    lib = kernels()
    if lib is not None:
        lib.llmopt_native_knobs(ctypes.byref(knobs))
    knobs.amx = amx_available() and os.environ.get(AMX_VARIABLE, "1") != "0"
    return knobs


def c_layouts(lib: ctypes.CDLL) -> dict[tuple[str, str | None], tuple[int, int]]:
    """kernels.c's struct layouts: (struct, field or None for the struct) -> (offset, size)."""
    layouts = {}
    names = [ctypes.c_char_p(), ctypes.c_char_p()]
    offset, size = ctypes.c_int64(), ctypes.c_int64()
    while lib.llmopt_native_layout(len(layouts), *map(ctypes.byref, (*names, offset, size))):
        field = names[1].value.decode() if names[1].value else None
        layouts[(names[0].value.decode(), field)] = (offset.value, size.value)
    return layouts


def require_native(graph: GraphSpec, kv_cache: KVCacheSpec) -> None:
    """A one-line error naming why the native step cannot run this graph here, if it cannot."""
    reason = unavailable_reason(graph, kv_cache)
    if reason is not None:
        raise ValueError(f"kernels: native cannot run {graph.file}: {reason}")


def machine_reason() -> str | None:
    """Why this install or CPU runs no native step at all, whatever the artifact, or None."""
    lib = kernels()
    if lib is None:
        return "this install has no native kernels (built without a C compiler)"
    if not lib.llmopt_native_supported():
        return "this CPU lacks AVX-512 VNNI, which the native kernels need"
    return None


def unavailable_reason(graph: GraphSpec, kv_cache: KVCacheSpec) -> str | None:
    """Why the native step cannot run this graph here, or None when it can."""
    machine = machine_reason()
    if machine is not None:
        return machine
    plan = read_plan(graph.native)
    if plan is None:
        return "the artifact predates native plans (recompile it)"
    if isinstance(plan, Unsupported):
        return plan.reason
    if kv_cache.layout != "lanes":
        return "the native step reads KV lanes only"
    for index, (layer, planned) in enumerate(zip(kv_cache.layers, plan.layers, strict=True)):
        dtype = lane_dtype(planned.kv)
        if any(t.dtype != dtype for t in layer.tensors):
            return f"layer {index}'s KV pool is not the {dtype} its graph stores"
    return None


def lane_dtype(kv: LaneKV | None) -> str:
    """The pool dtype of a layer's lanes (None: float32 lanes)."""
    if kv is None:
        return "float32"
    return {16: "float16", 8: "int8", 4: "uint8"}[kv.bits]
