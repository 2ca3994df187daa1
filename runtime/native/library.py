"""The compiled kernels (`_kernels*.so`, built from kernels.c at install) through ctypes."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import Any

from llmopt.runtime.manifest import GraphSpec, KVCacheSpec

c_ptr, c_i32, c_f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class QMatrix(ctypes.Structure):
    """kernels.c's QMatrix: codes, per-block scales and zero points of w [n, k] (blocks of
    `block` columns), sixteen rows interleaved (runtime/native/weights.py)."""

    _fields_ = [("codes", c_ptr), ("scales", c_ptr), ("zeros", c_ptr), ("offsets", c_ptr),
                ("n", c_i32), ("k", c_i32), ("bits", c_i32), ("block", c_i32),
                ("half_scales", c_ptr), ("bias", c_ptr)]


class QRows(ctypes.Structure):
    """kernels.c's QRows: QMatrix's fields up to `block`, rows in MatMulNBits' layout
    (embedding rows)."""

    _fields_ = QMatrix._fields_[:8]


class KVLayout(ctypes.Structure):
    """kernels.c's KVLayout: how one layer's lanes hold keys and values (32: float32; 16:
    float16; 8/4: codes with static per-channel scales), and the rotation of queries and
    keys, if any (hadamard: it is the Sylvester Hadamard matrix, run as the fast transform)."""

    _fields_ = [("bits", c_i32), ("key_scale", c_ptr), ("value_scale", c_ptr),
                ("rotation", c_ptr), ("hadamard", c_i32)]


class Model(ctypes.Structure):
    """kernels.c's Model: shapes, and pointers to every weight (arrays of L per layer)."""

    _fields_ = [("layers", c_i32), ("hidden", c_i32), ("heads", c_i32), ("kv_heads", c_i32),
                ("head_dim", c_i32), ("intermediate", c_i32), ("vocab", c_i32),
                ("max_position", c_i32), ("num_threads", c_i32), ("eps", c_f32),
                ("attn_scale", c_f32), ("rope_cos", c_ptr), ("rope_sin", c_ptr),
                ("embed", c_ptr), ("embed_codes", QRows), ("attn_norm", c_ptr),
                ("mlp_norm", c_ptr), ("final_norm", c_ptr), ("qkv", c_ptr), ("o", c_ptr),
                ("gate_up", c_ptr), ("down", c_ptr), ("head", QMatrix), ("kv", c_ptr),
                ("q_norm", c_ptr), ("k_norm", c_ptr)]


# kernels.c's exported functions: (return type, argument types)
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "llmopt_native_supported": (ctypes.c_int, []),
    "llmopt_forward": (ctypes.c_int, [ctypes.POINTER(Model), c_i32, c_ptr, c_ptr, c_ptr, c_ptr,
                                      c_ptr, c_ptr, c_ptr, c_i32, c_i32, c_ptr, c_ptr]),
    "llmopt_linear": (ctypes.c_int, [ctypes.POINTER(QMatrix), c_ptr, c_i32, c_ptr, c_i32]),
    "llmopt_attention": (ctypes.c_int, [ctypes.POINTER(KVLayout), c_ptr, c_i32, c_i32, c_ptr,
                                        c_ptr, c_i32, c_i32, c_f32, c_ptr, c_ptr]),
    "llmopt_native_amx": (ctypes.c_int, [ctypes.c_int]),
    "llmopt_native_amx_min_rows": (ctypes.c_int, [ctypes.c_int]),
    "llmopt_native_layer_rows": (ctypes.c_int, [ctypes.c_int]),
    "llmopt_native_split_rows": (ctypes.c_int, [ctypes.c_int]),
    "llmopt_native_read": (ctypes.c_uint64, [c_ptr, ctypes.c_int64, ctypes.c_int]),
    "llmopt_native_profile": (ctypes.c_int, [ctypes.c_int]),
    "llmopt_native_profile_name": (ctypes.c_char_p, [ctypes.c_int]),
    "llmopt_native_profile_seconds": (ctypes.c_double, [ctypes.c_int]),
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
    lib = declare_signatures(ctypes.CDLL(spec.origin))
    if lib.llmopt_native_supported():
        lib.llmopt_native_amx(os.environ.get(AMX_VARIABLE, "1") != "0")
    return lib


def profile_phases(lib: ctypes.CDLL) -> list[str]:
    """The phases kernels.c's step profile times (llmopt_native_profile), in its order."""
    names: list[str] = []
    while (name := lib.llmopt_native_profile_name(len(names))) is not None:
        names.append(name.decode())
    return names


def profile_seconds(lib: ctypes.CDLL) -> dict[str, float]:
    """Seconds each phase gathered since the profile was last turned on."""
    return {name: lib.llmopt_native_profile_seconds(i)
            for i, name in enumerate(profile_phases(lib))}


AMX_VARIABLE = "LLMOPT_NATIVE_AMX"  # "0": the native step never uses AMX tiles


def use_amx(enabled: bool) -> bool:
    """Lets the native step multiply on AMX tiles where the CPU has them (the default, unless
    LLMOPT_NATIVE_AMX=0), or never; returns whether it now does. Either way every output is
    the same, bit for bit (kernels.c): this only moves speed."""
    return _native_amx(int(enabled))


def amx_in_use() -> bool:
    """Whether the native step multiplies on AMX tiles (use_amx)."""
    return _native_amx(-1)


def _native_amx(want: int) -> bool:
    """kernels.c's llmopt_native_amx (want 1: on, 0: off, -1: only ask), False without it."""
    lib = kernels()
    return bool(lib is not None and lib.llmopt_native_supported() and lib.llmopt_native_amx(want))


def require_native(graph: GraphSpec, kv_cache: KVCacheSpec, lane_tokens: int | None = None
                   ) -> None:
    """A one-line error naming why the native step cannot run this graph here, if it cannot."""
    reason = unavailable_reason(graph, kv_cache, lane_tokens)
    if reason is not None:
        raise ValueError(f"kernels: native cannot run {graph.file}: {reason}")


def unavailable_reason(graph: GraphSpec, kv_cache: KVCacheSpec,
                       lane_tokens: int | None = None) -> str | None:
    """Why the native step cannot run this graph here, with lanes of `lane_tokens` tokens
    (None: any the graph allows), or None when it can."""
    lib = kernels()
    if lib is None:
        return "this install has no native kernels (built without a C compiler)"
    if not lib.llmopt_native_supported():
        return "this CPU lacks AVX-512 VNNI, which the native kernels need"
    plan: dict[str, Any] | None = graph.native
    if plan is None:
        return "the artifact predates native plans (recompile it)"
    if "unsupported" in plan:
        return plan["unsupported"]
    if kv_cache.layout != "lanes":
        return "the native step reads KV lanes only"
    window = plan.get("window")
    if window is not None and (lane_tokens is None or lane_tokens > window):
        # within its window a sliding window hides no key: the step attends to every row
        return (f"sliding windows of {window} tokens, shorter than the "
                f"{lane_tokens or 'max_context'} a lane holds (max_context <= {window} runs "
                "natively)")
    for index, (layer, planned) in enumerate(zip(kv_cache.layers, plan["layers"], strict=True)):
        dtype = lane_dtype(planned.get("kv"))
        if any(t.dtype != dtype for t in layer.tensors):
            return f"layer {index}'s KV pool is not the {dtype} its graph stores"
    return None


def lane_dtype(kv: dict[str, Any] | None) -> str:
    """The pool dtype of a layer's plan `kv` entry (None: float32 lanes)."""
    if kv is None:
        return "float32"
    return {16: "float16", 8: "int8", 4: "uint8"}[kv["bits"]]
