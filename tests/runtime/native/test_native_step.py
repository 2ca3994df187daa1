"""The native decoder step (runtime/native) against ONNX Runtime, on tiny checkpoints.

Activations are quantized to int8 per block of 32, so a tiny float difference anywhere
upstream (a norm summed in another order) can flip a rounding and move a logit by a few
percent: the whole step is compared with ONNX Runtime's within that noise, and one
projection, given the same input, within float rounding. What the native step adds is
determinism per token: a token's result does not depend on what else is in the step, so
batching, preemption and speculation change no greedy output.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from tiny_checkpoints import build_tiny_checkpoint
from tiny_quantized_gguf import write_tiny_gguf

from llmopt.compiler.kv_cache_format import hadamard
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.quant_format import QuantizedLinear, pack_matmul_nbits
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.executors.lanes import LaneExecutor
from llmopt.runtime.executors.native import NativeLaneExecutor
from llmopt.runtime.native.library import (
    AMX_VARIABLE,
    KVLayout,
    amx_available,
    default_knobs,
    kernels,
    profile_phases,
)
from llmopt.runtime.native.threads import ADAPTIVE_VARIABLE
from llmopt.runtime.native.weights import is_sylvester_hadamard, quantized_matrix

lib = kernels()
pytestmark = pytest.mark.skipif(lib is None or not lib.llmopt_native_supported(),
                                reason="no native kernels in this install, or no AVX-512 VNNI")
HAS_AMX = lib is not None and lib.llmopt_native_supported() and amx_available()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU (or kernel) has no AMX int8 tiles")
KNOBS = default_knobs() if lib is not None else None  # llmopt_linear's: a new model's


def knobs_of(llm: LLM):
    """The native step's knobs of `llm` (its model's: kernels.c's Knobs)."""
    return llm.engine.executor.weights.model.knobs


@pytest.fixture(autouse=True)
def fixed_threads(monkeypatch):
    """Each test runs the thread count it names; the governor would follow the machine's load."""
    monkeypatch.setenv(ADAPTIVE_VARIABLE, "0")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
A8 = {"nbits_accuracy_level": 4}


def rtn(symmetric: bool, head_bits: int, group_size: int = 32) -> dict:
    return {"rtn": {"bits": 4, "group_size": group_size, "symmetric": symmetric,
                    "include_lm_head": True, "lm_head_bits": head_bits}}


HEAD_DIM_64 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 64}
# head size 128 (Llama-3.1-8B's, Qwen2.5-7B's) with an untied LM head
HEAD_DIM_128 = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 128, "tie_word_embeddings": False}
STATIC = {"key_scales": "channel", "value_scales": "channel"}  # lanes read the codes in place
# the weight passes' defaults: the LM head at 8 bits, and int8 activations (target unset)
RTN_DEFAULT_HEAD = {"rtn": {"bits": 4, "group_size": 32, "symmetric": True}}
SUFFIX = {"draft": {"kind": "ngram", "ngram": {"method": "suffix", "min_confidence": 0.2},
                    "gamma": 4}}  # drafts trees with draft_tree=True
ARTIFACTS = {  # name -> (architecture, passes, target options)
    "llama-sym-h8": ("llama", [rtn(True, 8), SUFFIX], A8),
    # int8 KV codes of rotated keys and values (the rotation first: it folds into v_proj)
    "llama-kv-int8-rotate": ("llama", [{"kv_cache": {"dtype": "int8", **STATIC,
                                                     "rotate": True}}, rtn(True, 8)], A8),
    # int4 KV codes, one layer kept in float32; speculation rolls the codes back
    "llama-kv-int4-mixed": ("llama", [{"kv_cache": {"dtype": "int4", **STATIC,
                                                    "skip_layers": [1]}}, rtn(False, 4),
                                      SUFFIX], A8),
    # float16 KV lanes: queries and the attention output rounded to float16 as well
    "llama-kv-float16": ("llama", [{"kv_cache": {"dtype": "float16"}}, rtn(True, 8),
                                   {"draft": {"kind": "ngram", "gamma": 3}}], A8),
    # head size 64 (SmolLM2's; the tiny models' is 16): the attention loops kernels.c
    # unrolls for it, over int4 and float16 lanes
    "llama-d64-kv-int4": ("llama-d64", [{"kv_cache": {"dtype": "int4", **STATIC}},
                                         rtn(True, 8), SUFFIX], A8),
    "llama-d64-kv-float16": ("llama-d64", [{"kv_cache": {"dtype": "float16"}}, rtn(True, 8)],
                             A8),
    # three heads to rotate: fewer than rotate_heads' six at a time
    "llama-d64-kv-int8-rotate": ("llama-d64", [{"kv_cache": {"dtype": "int8", **STATIC,
                                                             "rotate": True}}, rtn(True, 8)], A8),
    "llama-asym-h4": ("llama", [rtn(False, 4)], A8),
    # wider blocks, on VNNI and AMX tiles: of 128 (hidden 64: one shorter block a row;
    # down_proj's K 128: one whole), and of 64 with zero points
    "llama-g128-kv-int8": ("llama", [{"kv_cache": {"dtype": "int8", **STATIC}},
                                     rtn(True, 4, 128), SUFFIX], A8),
    "llama-asym-g64-h8": ("llama", [rtn(False, 8, 64)], A8),
    # an intermediate of 96 in blocks of 64: down's input ends in a shorter block, and the
    # MLP's column ranges end off a block's edge at 2 and 3 threads
    "llama-i96-g64": ("llama-i96", [rtn(True, 8, 64)], A8),
    "llama-float-activations": ("llama", [rtn(True, 8)], {}),
    "llama-blocks": ("llama", [rtn(True, 8)], {**A8, "kv_layout": "blocks"}),
    # a sliding window of 12 on every layer (prompts run past it), float32 and int8 lanes
    "mistral-window": ("mistral", [rtn(True, 8), SUFFIX], A8),
    "mistral-window-kv8": ("mistral", [{"kv_cache": {"dtype": "int8", **STATIC}}, rtn(True, 8),
                                       SUFFIX], A8),
    "qwen2-bias": ("qwen2", [rtn(True, 8), SUFFIX], A8),  # q/k/v biases, after the projection
    # an RMS norm of each query and key head before rotary, over float32 and int8 lanes
    "qwen3-qk-norm": ("qwen3", [rtn(True, 8), SUFFIX], A8),
    "qwen3-qk-norm-kv8": ("qwen3", [{"kv_cache": {"dtype": "int8", **STATIC}}, rtn(True, 8)],
                          A8),
    "gguf-q4_1": ("gguf", [{"gguf_weights": {"include_lm_head": True}}], A8),
    # the fast recipes at real sizes' head sizes and biases, on the passes' defaults: int8 KV
    # with static scales, int4 weights, an 8-bit (untied) head; `rtn: {bits: 4}` as it is
    "llama-d128-kv-int8": ("llama-d128", [{"kv_cache": {"dtype": "int8", **STATIC}},
                                          RTN_DEFAULT_HEAD, SUFFIX], {}),
    "qwen2-bias-kv-int8": ("qwen2", [{"kv_cache": {"dtype": "int8", **STATIC}},
                                     RTN_DEFAULT_HEAD, SUFFIX], {}),
    "llama-rtn-defaults": ("llama", [{"rtn": {"bits": 4}}], {}),
    # a distilled one-layer draft model, compiled with the target's options: both native
    "llama-self-draft": ("llama", [rtn(True, 8), {"draft": {
        "kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3, "prompts": 2,
        "new_tokens": 12, "batch_sizes": [1, 2], "cost_repeats": 1}}], A8),
}


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    # GGUF Q4_1 blocks kept as they are: fractional zero points, lowered as group offsets
    gguf = write_tiny_gguf(root / "q4_1.gguf", {"attn": "Q4_1", "ffn": "Q4_1", "embd": "Q8_0"},
                           ffn=128)
    d64 = build_tiny_checkpoint("llama", root / "llama-d64", overrides=HEAD_DIM_64)
    i96 = build_tiny_checkpoint("llama", root / "llama-i96", overrides={"intermediate_size": 96})
    d128 = build_tiny_checkpoint("llama", root / "llama-d128", overrides=HEAD_DIM_128)
    sources = {**{arch: str(path) for arch, path in tiny_checkpoints.items()}, "gguf": str(gguf),
               "llama-d64": str(d64), "llama-i96": str(i96), "llama-d128": str(d128)}
    out = {}
    for name, (source, passes, target) in ARTIFACTS.items():
        recipe = Recipe(model=sources[source], passes=passes, target=target,
                        quality={"measure": False},
                        # the text alone: the tolerances below were measured on its scales
                        calibration={"text": str(word_text), "samples": 4, "seq_len": 64,
                                     "model_samples": 0},
                        runtime={"block_size": 4, "max_context": 128, "max_num_seqs": 16})
        out[name] = root / name
        compile_recipe(recipe, out[name], log=lambda _: None)
    return out


def requests() -> list[list[int]]:
    """16 prompts of different lengths; half share a 24-token prefix."""
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(3, 250, 24)]
    tails = [[int(t) for t in rng.integers(3, 250, 3 + 2 * i)] for i in range(16)]
    return [(prefix + t if i % 2 else t) for i, t in enumerate(tails)]


@pytest.mark.parametrize("bits,symmetric,block,k", [
    (4, True, 32, 192), (4, False, 32, 192), (8, True, 32, 192),
    (4, True, 128, 352), (4, True, 128, 96), (4, False, 64, 160), (8, True, 128, 192),
    (8, False, 64, 192)])
def test_a_projection_equals_matmul_nbits(bits, symmetric, block, k):
    """The same input, quantized the same way (activations in the weights' blocks): equal
    within float summation order. 70 rows run every kernel path: full tiles of eight (4-bit:
    the assembly loop), a partial tile, two row chunks, rows quantized by both threads; each
    row alone (the decode path) gives the same numbers. K 352 in blocks of 128 ends in a
    block of 96, 160 in blocks of 64 in one of 32."""
    rng = np.random.default_rng(bits + block)
    n = 48
    packed = _random_matrix(rng, n, k, bits, symmetric, block)
    rows = 70
    x = rng.standard_normal((rows, k)).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", *packed], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    graph = helper.make_graph(
        [node], "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        [numpy_helper.from_array(v if key != "scales" else v.reshape(-1), key)
         for key, v in packed.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": x})[0]
    arrays, matrix = quantized_matrix(packed["B"], packed["scales"], packed.get("zero_points"),
                                      n, k, bits, block=block)
    check_linear(matrix, x, expected, rows=(3, 9, 66))


def check_linear(matrix, x: np.ndarray, expected: np.ndarray, rows: tuple[int, ...]
                 ) -> np.ndarray:
    """The native projection of x equals `expected` at 1 and 2 threads, and one row at a time
    (the decode path) gives the batch's numbers exactly; returns the 2-thread output."""
    got = np.empty(expected.shape, np.float32)
    for threads in (1, 2):
        assert lib.llmopt_linear(ctypes.byref(matrix), x.ctypes.data, x.shape[0],
                                 got.ctypes.data, threads, KNOBS) == 0
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        one_row = np.empty((1, expected.shape[1]), np.float32)
        for row in rows:
            lib.llmopt_linear(ctypes.byref(matrix), x[row:row + 1].ctypes.data, 1,
                              one_row.ctypes.data, threads, KNOBS)
            assert np.array_equal(one_row[0], got[row])
    return got


@pytest.mark.parametrize("bits,symmetric,block", [(4, True, 128), (4, False, 32), (8, True, 32)])
def test_float16_scales_give_the_float32_scales_numbers(bits, symmetric, block):
    """Scales that are all exact float16 values (GGUF's) get a float16 copy, which steps of
    fewer than 8 rows stream instead: every row count computes what the float32 scales do,
    bit for bit; other scales get no copy."""
    rng = np.random.default_rng(bits + block)
    n, k, rows = 40, 256, 11
    packed = _random_matrix(rng, n, k, bits, symmetric, block)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    _, plain = quantized_matrix(packed["B"], packed["scales"], packed.get("zero_points"),
                                n, k, bits, block=block)
    assert not plain.half_scales
    halves = packed["scales"].astype(np.float16).astype(np.float32)
    arrays, exact = quantized_matrix(packed["B"], halves, packed.get("zero_points"), n, k,
                                     bits, block=block)  # (arrays: kept alive for the calls)
    assert exact.half_scales
    float_only = type(exact).from_buffer_copy(exact)
    float_only.half_scales = None
    for count in (1, 2, 5, 8, 11):
        with_half, without = (np.empty((count, n), np.float32) for _ in range(2))
        for matrix, y in ((exact, with_half), (float_only, without)):
            assert lib.llmopt_linear(ctypes.byref(matrix), x.ctypes.data, count,
                                     y.ctypes.data, 1, KNOBS) == 0
        assert np.array_equal(with_half, without)


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("dim", [16, 64, 80, 128])
def test_attention_over_a_lane_matches_exact_arithmetic(bits, dim):
    """One run of attention (llmopt_attention: 5 query tokens of a group of 3 heads, the
    first after 60 rows) against float64 on the same lane rows. float32 lanes: within float
    rounding. int8 lanes, whose dot products run on int16 codes of the queries and of the
    attention weights: within what 15 bits of each row's largest element allow. And a long
    flat row (a zero query: 700 equal weights, whose codes are scaled down to keep the sums
    in int32) gives the values' mean."""
    rng = np.random.default_rng(dim + bits)
    n, group, first_len, scale = 5, 3, 61, dim ** -0.5
    length = first_len + n - 1
    q = (3 * rng.standard_normal((n, group, dim))).astype(np.float32)
    keys, values = (rng.standard_normal((length, dim)).astype(np.float32) for _ in range(2))
    kv, scales, (key_rows, value_rows), (keys, values) = _lane_rows(bits, keys, values)

    def attend(q, key_rows, value_rows, first_len, n):
        out = np.empty((n, group, dim), np.float32)
        assert lib.llmopt_attention(ctypes.byref(kv), q.ctypes.data, n, group,
                                    key_rows.ctypes.data, value_rows.ctypes.data, first_len,
                                    dim, scale, None, out.ctypes.data) == 0
        return out

    got = attend(q, key_rows, value_rows, first_len, n)
    for i in range(n):
        seen = first_len + i
        scores = scale * q[i].astype(np.float64) @ keys[:seen].T.astype(np.float64)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        want = (weights / weights.sum(axis=1, keepdims=True)) @ values[:seen]
        np.testing.assert_allclose(got[i], want, rtol=0,
                                   atol=(3e-4 if bits == 8 else 1e-5) * np.abs(values).max())
    flat = rng.standard_normal((700, dim)).astype(np.float32)
    kv, scales, (key_rows, value_rows), (_, values) = _lane_rows(bits, flat, flat)
    got = attend(np.zeros((1, group, dim), np.float32), key_rows, value_rows, 700, 1)
    np.testing.assert_allclose(got[0], np.broadcast_to(values.mean(axis=0), (group, dim)),
                               rtol=0, atol=1e-5 * np.abs(values).max())


def _lane_rows(bits: int, keys: np.ndarray, values: np.ndarray):
    """A lane's keys and values in `bits` (8: codes of static per-channel scales): their
    KVLayout, the scales it points to (keep them), the rows, and the floats they stand for."""
    if bits == 32:
        return KVLayout(32, None, None, None), [], (keys, values), (keys, values)
    scales = [np.abs(x).max(axis=0) / 127 for x in (keys, values)]
    codes = [np.clip(np.round(x / s), -127, 127).astype(np.int8)
             for x, s in zip((keys, values), scales, strict=True)]
    kv = KVLayout(8, scales[0].ctypes.data, scales[1].ctypes.data, None)
    return kv, scales, codes, tuple(c * s for c, s in zip(codes, scales, strict=True))


@needs_amx
@pytest.mark.parametrize("bits,symmetric,block,k", [
    (4, True, 32, 192), (4, False, 32, 160), (8, True, 32, 96), (8, False, 32, 96),
    (4, True, 128, 320), (4, False, 128, 192), (4, True, 64, 192), (8, True, 128, 128)])
def test_amx_tiles_compute_the_vnni_result_bit_for_bit(bits, symmetric, block, k):
    """Every row count a tile of sixteen can meet (a partial tile, several tiles, more than
    a row chunk), an odd block count (k 160, 96; 192 in blocks of 64), a shorter last block
    of 64 (k 320 and 192 in blocks of 128) and both threads: AMX on and off give equal
    floats, so a step may multiply on either. Tiles from one row on, below the threshold a
    step uses, so that partial tiles run too."""
    knobs = default_knobs()
    knobs.amx_min_rows = 1
    rng = np.random.default_rng(bits + k + block)
    n = 40
    packed = _random_matrix(rng, n, k, bits, symmetric, block)
    arrays, matrix = quantized_matrix(packed["B"], packed["scales"], packed.get("zero_points"),
                                      n, k, bits, block=block)
    for rows in (1, 2, 7, 16, 17, 40, 130):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        results = []
        for amx in (False, True):
            knobs.amx = amx
            for threads in (1, 2):
                y = np.empty((rows, n), np.float32)
                assert lib.llmopt_linear(ctypes.byref(matrix), x.ctypes.data, rows,
                                         y.ctypes.data, threads, knobs) == 0
                results.append(y)
        for y in results[1:]:
            assert np.array_equal(y, results[0]), rows


def test_the_environment_can_turn_amx_off():
    """LLMOPT_NATIVE_AMX=0 keeps a process on the VNNI path; otherwise AMX is on where the
    CPU has it."""
    code = ("from llmopt.runtime.native.library import default_knobs; "
            "print(bool(default_knobs().amx))")
    for value, expected in (("0", False), ("1", HAS_AMX)):
        printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env={**os.environ, AMX_VARIABLE: value}, check=True).stdout
        assert printed.strip() == str(expected)


def _random_matrix(rng: np.random.Generator, n: int, k: int, bits: int, symmetric: bool,
                   block: int = 32) -> dict[str, np.ndarray]:
    """MatMulNBits' B, scales (and zero_points) of random block-quantized weights."""
    levels, blocks = 2 ** bits, -(-k // block)
    zeros = (np.full((n, blocks), levels // 2, np.float32) if symmetric
             else rng.integers(0, levels, (n, blocks)).astype(np.float32))
    return pack_matmul_nbits(QuantizedLinear(
        bits=bits, group_size=block,
        codes=_torch(rng.integers(0, levels, (n, k)).astype(np.uint8)),
        scales=_torch(rng.uniform(1e-3, 2e-2, (n, blocks)).astype(np.float32)),
        zeros=_torch(zeros), symmetric=symmetric))


def test_the_kv_cache_pass_rotation_runs_as_the_fast_transform(artifacts):
    """Its matrix is recognised (and nothing else is): kernels.c then rotates by the fast
    Walsh-Hadamard transform (test_the_step_matches_onnx_runtime checks what it computes:
    a wrong sign in any stage moves every key code)."""
    for size in (16, 32, 64, 128, 256):
        assert is_sylvester_hadamard(hadamard(size))
    flipped = hadamard(64)
    flipped[3, 5] *= -1
    rng = np.random.default_rng(0)
    orthogonal = np.linalg.qr(rng.standard_normal((64, 64)))[0].astype(np.float32)
    for other in (hadamard(8), hadamard(512), flipped, -hadamard(64), orthogonal):
        assert not is_sylvester_hadamard(other)
    for name, rotated in (("llama-kv-int8-rotate", 1), ("llama-kv-float16", 0)):
        executor = LLM(artifacts[name], kernels="native", speculative=False).engine.executor
        model = executor.weights.model
        layouts = ctypes.cast(model.kv, ctypes.POINTER(KVLayout))
        assert [layouts[i].hadamard for i in range(model.layers)] == [rotated] * model.layers


def _codes(lane: np.ndarray) -> np.ndarray:
    """A lane's int codes: int8 as they are, int4 unpacked (two a byte, low nibble first)."""
    if lane.dtype == np.int8:
        return lane.astype(np.int16)
    return np.stack([lane & 15, lane >> 4], axis=-1).astype(np.int16) - 8


def _torch(array: np.ndarray):
    import torch

    return torch.from_numpy(array)


@pytest.mark.parametrize("name", ["llama-sym-h8", "llama-asym-h4", "gguf-q4_1",
                                  "llama-kv-int8-rotate", "llama-kv-int4-mixed",
                                  "llama-kv-float16", "llama-d64-kv-int4",
                                  "llama-d64-kv-int8-rotate", "llama-g128-kv-int8",
                                  "llama-asym-g64-h8", "qwen2-bias", "qwen3-qk-norm",
                                  "qwen3-qk-norm-kv8", "llama-d128-kv-int8",
                                  "qwen2-bias-kv-int8", "llama-rtn-defaults",
                                  "mistral-window", "mistral-window-kv8"])
def test_the_step_matches_onnx_runtime(name, artifacts):
    native, reference = (LLM(artifacts[name], kernels=k, speculative=False)
                         for k in ("native", "onnxruntime"))
    assert isinstance(native.engine.executor, NativeLaneExecutor)
    plan = native.manifest.graphs["target"].native
    assert (plan["layers"][0]["qkv"]["offsets"] is not None) == (name == "gguf-q4_1")
    assert plan["layers"][0]["down"]["block"] == {"llama-g128-kv-int8": 128,
                                                  "llama-rtn-defaults": 128,
                                                  "llama-asym-g64-h8": 64}.get(name, 32)
    if ARTIFACTS[name][2] == {}:  # the defaults: an 8-bit head, int8 activations
        assert plan["head"]["bits"] == 8
    if name == "llama-asym-g64-h8":  # the embedding gathered from the head's codes
        assert plan["embed"]["codes"]["block"] == 64
    tokens = (requests()[1] * 4)[:100]
    got, expected = native.score(tokens), reference.score(tokens)
    # log-probs: int8-activation rounding noise. float16: one activation code flipped at
    # position 5 in layer 1 (measured) changes layer 2's key there, which every later token
    # reads. Head size 64, rotated int8 keys: the rotation's 64-term sums, added by the fast
    # transform here and in another order by ONNX Runtime's MatMul, flip key codes from
    # position 1 on (max 0.125, mean 0.014, 12 % of key codes off, by up to 4, measured; one
    # head left unrotated: max 12, mean 3.6). int8 keys and values: one code flipped by a
    # rounding tie in layer 1 at position 33 (measured, kv-int8-rotate) moves every later
    # token's layer-1 attention a little, and layer 2's codes from there on. Attention on
    # int8 lanes runs on int16 codes of the queries and weights (kernels.c), ~1e-4 of the
    # values' range from exact arithmetic (test_attention_over_a_lane_matches_exact_
    # arithmetic), where ONNX Runtime's float attention is ~1e-7 from it: on these random
    # checkpoints that flips activation codes in every layer, so 40-49 % of layer 2's codes
    # differ, by up to 6 (log-probs max 0.12-0.30, mean 0.024-0.064; measured). Layer 0's
    # codes come before any attention. (Qwen3's normed heads: 41 % of layer 2's codes off,
    # by up to 6; log-probs max 0.15, mean 0.024, measured.)
    int8_kv = (0.25, 0.055, 0.6, 5)
    largest, mean, flipped, off_by = {"llama-kv-float16": (0.1, 0.025, 0.05, 2),
                                      "llama-d64-kv-int8-rotate": (0.5, 0.1, 0.7, 8),
                                      "llama-kv-int8-rotate": int8_kv,
                                      "llama-g128-kv-int8": int8_kv,
                                      "qwen3-qk-norm-kv8": (*int8_kv[:3], 6),
                                      # far more sensitive to int8 KV than the others:
                                      # ONNX Runtime's own int8 lanes move its log-probs by
                                      # nats against float lanes; layer 0's codes still match
                                      "llama-d128-kv-int8": (1.2, 0.2, 0.6, 16),
                                      "qwen2-bias-kv-int8": int8_kv,
                                      "mistral-window-kv8": (*int8_kv[:3], 6),
                                      }.get(name, (0.1, 0.01, 0.05, 2))
    assert np.abs(got - expected).max() < largest
    assert np.abs(got - expected).mean() < mean
    # KV lands where ONNX Runtime's GroupQueryAttention puts it, as it stores it: lane 0,
    # positions 0..99, float32 or the same codes (but where a rounding flipped upstream)
    for name in native.engine.executor.pools:
        got, expected = (llm.engine.executor.pools[name][0, :, : len(tokens)]
                         for llm in (native, reference))
        first_layer = name.startswith("past.0.")
        assert got.dtype == expected.dtype
        if got.dtype in (np.float32, np.float16):
            np.testing.assert_allclose(got, expected, atol=0.05 * np.abs(expected).max())
        else:
            codes = [_codes(array) for array in (got, expected)]
            assert np.mean(codes[0] != codes[1]) < (0.01 if first_layer else flipped)
            assert np.abs(codes[0] - codes[1]).max() <= off_by


@pytest.mark.parametrize("name", ["llama-sym-h8", "llama-self-draft", "llama-kv-int4-mixed",
                                  "llama-kv-float16", "llama-d64-kv-int4",
                                  "llama-g128-kv-int8", "qwen2-bias", "qwen3-qk-norm",
                                  "llama-d128-kv-int8", "qwen2-bias-kv-int8",
                                  "mistral-window", "mistral-window-kv8"])
def test_batching_preemption_and_speculation_change_nothing(name, artifacts):
    prompts = requests()
    llm = LLM(artifacts[name], kernels="native", speculative=False)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    assert sum(o.metrics.num_cached_tokens for o in together) > 0  # prefixes were shared
    small = LLM(artifacts[name], kernels="native", num_blocks=60, max_context=96,
                speculative=False)
    assert [o.token_ids for o in small.generate(prompts, GREEDY)] == alone
    speculating = LLM(artifacts[name], kernels="native", adaptive_speculation=False,
                      speculative_max_batch_size=16)  # a draft model it cannot run: ONNX Runtime
    outputs = speculating.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == alone
    assert sum(o.metrics.speculation.num_spec_steps for o in outputs) > 0


def _same_outputs_at(knob: str, small: int, artifact: Path, **options: Any) -> None:
    """100 tokens' log-probs and requests()' greedy tokens (speculating, trees where the
    artifact drafts) are the same, bit for bit, with the model's `knob` at `small` as
    with it out of reach."""
    tokens, prompts = (requests()[1] * 4)[:100], requests()

    def outputs(value: int) -> tuple[np.ndarray, list[list[int]]]:
        llm = LLM(artifact, kernels="native", adaptive_speculation=False,
                  speculative_max_batch_size=16, **options)
        setattr(knobs_of(llm), knob, value)
        generated = llm.generate(prompts, GREEDY)
        if "self-draft" in artifact.name:
            assert sum(o.metrics.speculation.num_spec_steps for o in generated) > 0
        return llm.score(tokens), [o.token_ids for o in generated]

    whole = outputs(1 << 20)
    changed = outputs(small)
    np.testing.assert_array_equal(changed[0], whole[0])
    assert changed[1] == whole[1]


@pytest.mark.parametrize("name", ["llama-self-draft", "llama-d64-kv-int8-rotate"])
def test_a_layer_run_in_row_chunks_computes_the_same(name, artifacts):
    """llmopt_forward runs each layer over a step's rows a chunk at a time: chunks of 5 rows
    (cutting query runs and draft trees mid-way, each under AMX's 16 rows) give the same
    log-probs and tokens, bit for bit, as one chunk for every step."""
    _same_outputs_at("layer_rows", 5, artifacts[name])


@pytest.mark.parametrize("threads", [2, 3])
def test_a_layer_split_by_rows_between_threads_computes_the_same(threads, artifacts):
    """With many rows a step, each thread runs a layer on its own rows (layer_split), meeting
    the others once, after the KV write: splitting from 3 rows a thread (a scored sequence's
    rows cut between threads, so attention reads keys another thread wrote; draft trees and
    batches alike) gives the same log-probs and tokens, bit for bit, as never splitting."""
    _same_outputs_at("split_rows", 3, artifacts["llama-self-draft"],
                     num_threads=threads)


@pytest.mark.parametrize("name", ["llama-i96-g64", "llama-g128-kv-int8", "gguf-q4_1"])
def test_any_thread_count_computes_the_same(name, artifacts):
    """Every phase splits its work between threads without changing a sum: the MLP's
    columns (kernels.c's mlp: gate and up in ranges of whole blocks of down's input, ranges
    that end off a block's edge here at 2 and 3 threads, or leave a thread none), every
    projection's row groups, attention's runs. 100 tokens' log-probs and a batch's greedy
    tokens are the same, bit for bit, at 1, 2 and 3 threads."""
    tokens, prompts = (requests()[1] * 4)[:100], requests()
    results = []
    for threads in (1, 2, 3):
        llm = LLM(artifacts[name], kernels="native", speculative=False, num_threads=threads)
        results.append((llm.score(tokens), [o.token_ids for o in llm.generate(prompts, GREEDY)]))
    for log_probs, greedy in results[1:]:
        np.testing.assert_array_equal(log_probs, results[0][0])
        assert greedy == results[0][1]


def test_the_phase_profile_times_every_phase_and_changes_no_output(artifacts):
    """The phase profile (benchmarks/native_step_profile.py): with it on, a prefill and
    greedy decoding give the same log-probs and tokens, every phase gathers time, and the
    phases fit in the wall time; off, nothing more gathers."""
    names = profile_phases(lib)
    assert names == ["embed", "qkv", "kv_write", "attend", "o", "norms", "gate_up", "silu",
                     "down", "head"]
    llm = LLM(artifacts["llama-sym-h8"], kernels="native", speculative=False)
    tokens, prompts = (requests()[1] * 4)[:100], requests()
    plain = (llm.score(tokens), [o.token_ids for o in llm.generate(prompts, GREEDY)])
    weights = llm.engine.executor.weights
    assert weights.profile(True) is False
    started = time.perf_counter()
    profiled = (llm.score(tokens), [o.token_ids for o in llm.generate(prompts, GREEDY)])
    wall = time.perf_counter() - started
    assert weights.profile(False) is True
    seconds = list(weights.profile_seconds().values())
    assert np.array_equal(plain[0], profiled[0]) and plain[1] == profiled[1]
    assert all(s > 0 for s in seconds), dict(zip(names, seconds, strict=True))
    assert sum(seconds) < wall
    llm.score(tokens)
    assert list(weights.profile_seconds().values()) == seconds


@needs_amx
@pytest.mark.parametrize("name", ["llama-sym-h8", "llama-asym-h4", "gguf-q4_1",
                                  "llama-kv-int4-mixed", "llama-g128-kv-int8",
                                  "llama-asym-g64-h8"])
def test_amx_tiles_change_no_step_output(name, artifacts):
    """A prefill (its chunks take AMX tiles), a batch of 16 and greedy decoding: the same
    log-probs and tokens, bit for bit, with AMX on and off."""
    tokens, prompts = (requests()[1] * 4)[:100], requests()
    results = []
    for amx in (False, True):
        llm = LLM(artifacts[name], kernels="native", speculative=False)
        assert llm.engine.executor.weights.use_amx(amx) == amx
        results.append((llm.score(tokens), [o.token_ids for o in llm.generate(prompts, GREEDY)]))
    assert np.array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


@pytest.mark.parametrize("name", ["llama-sym-h8", "llama-kv-int4-mixed", "llama-kv-float16",
                                  "llama-d64-kv-int4", "llama-d64-kv-float16",
                                  "llama-d64-kv-int8-rotate", "mistral-window",
                                  "mistral-window-kv8"])
def test_a_lanes_run_of_tokens_attends_as_each_token_would_alone(name, artifacts):
    """A step's consecutive tokens of one lane attend together (kernels.c's attend_run,
    runs of up to 8): each token's logits equal, bit for bit, what the same token gives
    fed alone, one step at a time, and a second sequence in the step changes nothing."""
    from llmopt.runtime.executors.step_batch import SequenceStep, make_step_batch

    def executor():
        llm = LLM(artifacts[name], kernels="native", speculative=False)
        return llm.engine.executor, llm.engine.config

    prompt, other = requests()[5], requests()[8]
    tokens = [int(t) for t in np.random.default_rng(9).integers(3, 250, 11)]
    together, config = executor()
    size, lane_blocks = config.block_size, config.max_context // config.block_size
    blocks, other_blocks = (list(range(1 + lane * lane_blocks, 1 + (lane + 1) * lane_blocks))
                            for lane in (0, 1))  # lanes 0 and 1 (block 0 is the null block)
    rows = range(len(prompt) + len(tokens))
    got = together.execute(make_step_batch(
        [SequenceStep(prompt + tokens, 0, blocks, rows),
         SequenceStep(other, 0, other_blocks, [len(other) - 1])], size))
    alone, _ = executor()
    alone.execute(make_step_batch([SequenceStep(prompt, 0, blocks, [])], size))
    for i, token in enumerate(tokens):
        position = len(prompt) + i
        row = alone.execute(make_step_batch([SequenceStep([token], position, blocks, [0])],
                                            size))
        assert np.array_equal(row[0], got[position]), f"token {i}"


@pytest.mark.parametrize("name,threads,layer_rows", [
    ("llama-sym-h8", 1, None), ("llama-kv-int4-mixed", 2, None), ("llama-g128-kv-int8", 2, 5),
    ("llama-d64-kv-int8-rotate", 3, None)])
def test_the_last_layer_runs_only_the_rows_whose_logits_a_step_returns(name, threads,
                                                                      layer_rows, artifacts):
    """Where a step returns some rows' logits (a prefill, its last token's), the last layer
    takes only those rows past the KV write (kernels.c's last_layer_chunk): their logits
    equal, bit for bit, the same rows' of the same step returning every row's, and so do
    the lanes it writes; also with the rows cut into chunks of 5 (the kept rows of several
    chunks) and split between threads."""
    from llmopt.runtime.executors.step_batch import SequenceStep, make_step_batch

    def run(wanted: list[list[int]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        llm = LLM(artifacts[name], kernels="native", speculative=False, num_threads=threads)
        if layer_rows:
            knobs_of(llm).layer_rows = layer_rows
        knobs_of(llm).split_rows = 3  # two or three threads split the layer's rows
        size = llm.engine.config.block_size
        lane_blocks = llm.engine.config.max_context // size
        steps = [SequenceStep(prompt, 0, list(range(1 + i * lane_blocks,
                                                   1 + (i + 1) * lane_blocks)), rows)
                 for i, (prompt, rows) in enumerate(zip(prompts, wanted, strict=True))]
        executor = llm.engine.executor
        return executor.execute(make_step_batch(steps, size)), dict(executor.pools)

    prompts = [requests()[i] for i in (13, 4, 9)]  # 53, 11 and 45 tokens
    some = [[len(prompts[0]) - 1], [], [0, 7, 8, len(prompts[2]) - 1]]
    every, every_lanes = run([range(len(p)) for p in prompts])
    got, lanes = run(some)
    starts = np.cumsum([0] + [len(p) for p in prompts])
    rows = [start + r for start, wanted in zip(starts, some, strict=False) for r in wanted]
    assert np.array_equal(got, every[rows])
    for pool, values in every_lanes.items():
        np.testing.assert_array_equal(lanes[pool], values)


@pytest.mark.parametrize("name", ["llama-sym-h8", "llama-kv-int4-mixed", "llama-g128-kv-int8",
                                  "mistral-window", "mistral-window-kv8"])
def test_a_draft_tree_attends_as_each_branch_would_as_a_chain(name, artifacts):
    """A tree step (two branches under the last known token, a third under the first
    branch's first node) gives each node, bit for bit, the logits the same tokens give
    as a chain of its branch, and writes the same codes; a move brings a branch's
    entries to the positions a chain would have put them in."""
    from llmopt.runtime.executors.step_batch import SequenceStep, make_step_batch

    def executor():
        llm = LLM(artifacts[name], kernels="native", speculative=False)
        return llm.engine.executor, llm.engine.config.block_size

    prompt = requests()[7]
    root, nodes = prompt[-1], [11, 12, 13, 21, 22, 31]
    parents = [-1, 0, 1, -1, 3, 0]  # branches 11-12-13, 21-22 and 11-31
    tree, size = executor()
    blocks = list(range(1, 1 + 128 // size))
    tree.execute(make_step_batch([SequenceStep(prompt[:-1], 0, blocks, [])], size))
    start = len(prompt) - 1
    query_parents = [-1] + [p + 1 for p in parents]
    got = tree.execute(make_step_batch([SequenceStep(
        [root, *nodes], start, blocks, range(7), query_parents)], size))
    for branch in ([11, 12, 13], [21, 22], [11, 31]):
        chain, _ = executor()
        chain.execute(make_step_batch([SequenceStep(prompt[:-1], 0, blocks, [])], size))
        want = chain.execute(make_step_batch([SequenceStep(
            [root, *branch], start, blocks, range(len(branch) + 1))], size))
        rows = [0] + [1 + next(i for i, (t, p) in enumerate(zip(nodes, parents, strict=True))
                               if t == token and (depth == 0 or nodes[p] == branch[depth - 1]))
                      for depth, token in enumerate(branch)]
        assert np.array_equal(got[rows], want), f"branch {branch}"
        if branch == [21, 22]:  # the second branch's entries, moved where the chain's are
            tree.move_entries(blocks, [start + 4, start + 5], [start + 1, start + 2])
            for pool in tree.pools:
                written = slice(start, start + 3)
                np.testing.assert_array_equal(tree.pools[pool][0, :, written],
                                              chain.pools[pool][0, :, written])


def test_draft_trees_change_no_greedy_output(artifacts):
    """Suffix drafts as trees, verified under the tree mask: alone, and batched with
    shared prefixes in a pool of fewer lanes than requests, the outputs are plain
    decoding's. (Which branch wins is up to the random tiny model; the engine's tests in
    tests/runtime/speculative/test_suffix.py make side branches win, also under preemption.)"""
    prompts = [p + p[-9:] * 2 for p in requests()]  # repeats give the n-gram drafts matches
    plain = LLM(artifacts["llama-sym-h8"], kernels="native", speculative=False)
    alone = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]
    for options in ({}, {"num_blocks": 60}):
        llm = LLM(artifacts["llama-sym-h8"], draft_tree=True, adaptive_speculation=False,
                  speculative_max_batch_size=16, **options)
        outputs = ([llm.generate([p], GREEDY)[0] for p in prompts] if not options
                   else llm.generate(prompts, GREEDY))
        assert [o.token_ids for o in outputs] == alone
        assert sum(o.metrics.speculation.num_accepted_tokens for o in outputs) > 0


def test_draft_trees_need_a_suffix_draft_and_the_native_step(artifacts):
    with pytest.raises(ValueError, match="draft_tree needs a target that runs draft trees"):
        LLM(artifacts["llama-sym-h8"], kernels="onnxruntime", draft_tree=True)
    with pytest.raises(ValueError, match="draft_tree verifies at most 63 drafts a step"):
        LLM(artifacts["llama-sym-h8"], draft_tree=True, num_speculative_tokens=64)
    for name in ("llama-kv-float16", "llama-asym-h4"):  # prompt lookup; no draft at all
        with pytest.raises(ValueError, match="draft_tree needs speculation with the "
                                             "artifact's n-gram draft of method: suffix"):
            LLM(artifacts[name], draft_tree=True)


@pytest.mark.parametrize("name,reason", [
    ("llama-float-activations", "float activations"),
    ("llama-blocks", "not a lanes graph"),
])
def test_what_it_cannot_run_it_says(name, reason, artifacts):
    with pytest.raises(ValueError, match=r"^kernels: native cannot run target\.onnx: .*"
                       + reason.replace("(", r"\(").replace(")", r"\)")):
        LLM(artifacts[name], kernels="native")
    if name != "llama-blocks":  # auto: ONNX Runtime, as before
        assert isinstance(LLM(artifacts[name], kernels="auto").engine.executor, LaneExecutor)


@pytest.mark.parametrize("name", ["mistral-window", "mistral-window-kv8"])
@pytest.mark.parametrize("step_tokens", [None, 10])
def test_a_sliding_window_runs_natively_as_onnx_runtime_runs_it(name, step_tokens, artifacts):
    """Lanes far longer than the tiny Mistral's window (12 of 128): the native step reads
    each query's window only. Four prompts of 11 to 57 tokens, batched, their prefills in
    one step or chunks of 10, decoded 24 greedy tokens: on float32 lanes ONNX Runtime's
    tokens; on int8 lanes (where the step's integer attention leaves ONNX Runtime's greedy
    path within a few tokens on these random models, windows or not) the log-probs of
    ONNX Runtime's tokens within test_the_step_matches_onnx_runtime's int8 tolerance."""
    native, reference = (LLM(artifacts[name], kernels=k, speculative=False,
                             max_num_batched_tokens=step_tokens)
                         for k in ("native", "onnxruntime"))
    assert isinstance(native.engine.executor, NativeLaneExecutor)
    assert native.manifest.graphs["target"].native["window"] == 12
    prompts = requests()[4:16:3]
    got, expected = (llm.generate(prompts, GREEDY) for llm in (native, reference))
    if name == "mistral-window":
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        return
    for prompt, output in zip(prompts, expected, strict=True):
        tokens = prompt + output.token_ids
        difference = np.abs(native.score(tokens) - reference.score(tokens))
        assert difference.max() < 0.25 and difference.mean() < 0.055


def test_a_window_hides_the_keys_before_it():
    """One run of attention with a window of 7 (llmopt_attention: 5 query tokens after 20
    rows) against float64 over each token's last 7 rows; and the same rows fed from the
    first token's window on give the same result, bit for bit, as from row 0."""
    rng = np.random.default_rng(3)
    n, group, first_len, dim, window = 5, 2, 21, 64, 7
    q = rng.standard_normal((n, group, dim)).astype(np.float32)
    keys, values = (rng.standard_normal((first_len + n - 1, dim)).astype(np.float32)
                    for _ in range(2))
    for bits in (32, 8):
        kv, scales, (key_rows, value_rows), (k_float, v_float) = _lane_rows(bits, keys, values)
        kv.window = window
        out = np.empty((n, group, dim), np.float32)
        assert lib.llmopt_attention(ctypes.byref(kv), q.ctypes.data, n, group,
                                    key_rows.ctypes.data, value_rows.ctypes.data, first_len,
                                    dim, dim ** -0.5, None, out.ctypes.data) == 0
        for i in range(n):
            seen = slice(first_len + i - window, first_len + i)
            scores = dim ** -0.5 * q[i].astype(np.float64) @ k_float[seen].T
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            want = (weights / weights.sum(axis=1, keepdims=True)) @ v_float[seen]
            np.testing.assert_allclose(out[i], want, rtol=0,
                                       atol=(3e-4 if bits == 8 else 1e-5) * np.abs(values).max())
            alone = np.empty((1, group, dim), np.float32)
            assert lib.llmopt_attention(ctypes.byref(kv), q[i].ctypes.data, 1, group,
                                        key_rows.ctypes.data, value_rows.ctypes.data,
                                        first_len + i, dim, dim ** -0.5, None,
                                        alone.ctypes.data) == 0
            assert np.array_equal(alone[0], out[i]), f"{bits}-bit lanes, token {i}"


def test_a_draft_tree_deeper_than_the_window_is_refused(artifacts):
    from llmopt.runtime.executors.step_batch import SequenceStep, make_step_batch

    llm = LLM(artifacts["mistral-window"], kernels="native", speculative=False)
    executor, size = llm.engine.executor, llm.engine.config.block_size
    blocks = list(range(1, 1 + 128 // size))
    chain = list(range(3, 16))  # 13 tokens, each under the one before: depth 12
    with pytest.raises(ValueError, match="a draft tree 13 tokens deep does not fit the "
                                         "sliding window of 12"):
        executor.execute(make_step_batch([SequenceStep(
            chain, 20, blocks, [0], [-1, *range(12)])], size))


def test_auto_is_the_default_and_takes_the_native_step(artifacts):
    llm = LLM(artifacts["llama-asym-h4"])
    assert isinstance(llm.engine.executor, NativeLaneExecutor)
    assert llm.kernels_in_use().startswith("native")
    assert isinstance(LLM(artifacts["llama-asym-h4"], kernels="onnxruntime").engine.executor,
                      LaneExecutor)


def test_an_unknown_kernels_value_is_refused(artifacts):
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of onnxruntime, native"):
        LLM(artifacts["llama-asym-h4"], kernels="cuda")
