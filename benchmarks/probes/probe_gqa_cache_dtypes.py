"""What ONNX Runtime's CPU GroupQueryAttention does with each KV cache dtype, in a lane it
shares in place (past and present bound to one buffer, as the lanes layout binds them):
which positions of each row's lane a call writes, and how long a decode call takes.

Why the lanes layout runs a float16 cache's node wholly in float16 (queries, keys, values
and output; `float16-node`): a float16 cache under float32 queries (`float16`) rewrites
each row's lane from the step's first position to the end (idle rows included), and costs
several times a float32 call. float32, int8 and int4 (static per-channel scales) take
float32 queries. Prints a table; writes benchmarks/results/probe_gqa_cache_dtypes.json.

    python benchmarks/probes/probe_gqa_cache_dtypes.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common and the benchmarks
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2's attention
CACHES = {  # name -> (ONNX element type, numpy dtype, quantized bit width or 0, queries' type)
    "float32": (TensorProto.FLOAT, np.float32, 0, TensorProto.FLOAT),
    "float16": (TensorProto.FLOAT16, np.float16, 0, TensorProto.FLOAT),
    "float16-node": (TensorProto.FLOAT16, np.float16, 0, TensorProto.FLOAT16),
    "int8": (TensorProto.INT8, np.int8, 8, TensorProto.FLOAT),
    "int4": (TensorProto.UINT8, np.uint8, 4, TensorProto.FLOAT),
}


def session(cache: str, capacity: int) -> ort.InferenceSession:
    element, _, bits, query = CACHES[cache]
    attrs: dict[str, Any] = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "do_rotary": 0}
    inputs = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", *[""] * 5,
              "k_scale" if bits else "", "v_scale" if bits else "", "", "", "query_seqlens"]
    if bits:
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                     kv_cache_bit_width=bits)
    width = HEAD_DIM // 2 if bits == 4 else HEAD_DIM
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "present_k", "present_v"],
                            domain="com.microsoft", **attrs)
    info = helper.make_tensor_value_info
    graph_inputs = [
        info("q", query, ["B", "S", HEADS * HEAD_DIM]),
        info("k", query, ["B", "S", KV_HEADS * HEAD_DIM]),
        info("v", query, ["B", "S", KV_HEADS * HEAD_DIM]),
        info("past_k", element, ["B", KV_HEADS, capacity, width]),
        info("past_v", element, ["B", KV_HEADS, capacity, width]),
        info("seqlens_k", TensorProto.INT32, ["B"]), info("total", TensorProto.INT32, []),
        info("query_seqlens", TensorProto.INT32, ["B"])]
    scales = [helper.make_tensor(n, TensorProto.FLOAT, [KV_HEADS * HEAD_DIM],
                                 [0.05] * (KV_HEADS * HEAD_DIM)) for n in ("k_scale", "v_scale")]
    outputs = [info("out", query, None), info("present_k", element, None),
               info("present_v", element, None)]
    model = helper.make_model(
        helper.make_graph([node], "gqa", graph_inputs, outputs, scales if bits else []),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def bound_call(sess: ort.InferenceSession, cache: str, queries: np.ndarray,
               seqlens: np.ndarray, pool: np.ndarray):
    """An IO binding with the pool as past and present (in place), and a run function."""
    rng = np.random.default_rng(0)
    rows, steps = len(seqlens), int(queries.max())
    binding = sess.io_binding()
    dtype = np.float16 if CACHES[cache][3] == TensorProto.FLOAT16 else np.float32
    feeds = {"q": rng.standard_normal((rows, steps, HEADS * HEAD_DIM)).astype(dtype),
             "k": rng.standard_normal((rows, steps, KV_HEADS * HEAD_DIM)).astype(dtype),
             "v": rng.standard_normal((rows, steps, KV_HEADS * HEAD_DIM)).astype(dtype),
             "seqlens_k": seqlens.astype(np.int32), "query_seqlens": queries.astype(np.int32),
             "total": np.array(int(seqlens.max()) + 1, np.int32)}
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for side in ("k", "v"):
        value = ort.OrtValue.ortvalue_from_numpy(pool if side == "k" else pool.copy())
        binding.bind_ortvalue_input(f"past_{side}", value)
        binding.bind_ortvalue_output(f"present_{side}", value)
    binding.bind_output("out")
    return lambda: sess.run_with_iobinding(binding)


def written_positions(cache: str) -> list[list[int]]:
    """Lane positions each row's call changed: rows (past, new) = (10, 6), idle (0, 0), (3, 2)."""
    _, dtype, bits, _ = CACHES[cache]
    capacity, width = 32, HEAD_DIM // 2 if bits == 4 else HEAD_DIM
    queries, seqlens = np.array([6, 0, 2]), np.array([15, 0, 4])  # seqlens_k = past + new - 1
    pool = np.random.default_rng(1).integers(0, 100, (3, KV_HEADS, capacity, width)).astype(dtype)
    before = pool.copy()
    bound_call(session(cache, capacity), cache, queries, seqlens, pool)()
    return [np.nonzero((pool[r] != before[r]).any(axis=(0, 2)))[0].tolist() for r in range(3)]


def decode_call_us(cache: str, context: int, capacity: int, calls: int = 300) -> float:
    """Microseconds of one batch-1 decode call at `context` tokens in a `capacity` lane."""
    _, dtype, bits, _ = CACHES[cache]
    pool = np.zeros((1, KV_HEADS, capacity, HEAD_DIM // 2 if bits == 4 else HEAD_DIM), dtype)
    run = bound_call(session(cache, capacity), cache, np.array([1]), np.array([context]), pool)
    for _ in range(20):
        run()
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    rows = []
    for cache in CACHES:
        row = {"cache": cache, "written": written_positions(cache),
               **{f"us_at_{n}": decode_call_us(cache, n, 2048) for n in (128, 1024)}}
        rows.append(row)
        spans = ", ".join(f"{w[0]}-{w[-1]}" if w else "none" for w in row["written"])
        print(f"{cache:<12} writes rows' positions {spans:<22} decode call in a 2048 lane: "
              f"{row['us_at_128']:.1f} us at 128 tokens, {row['us_at_1024']:.1f} us at 1024")
    print("the new positions only would be 10-15, none, 3-4 (of a 32-token lane)")
    write_json(RESULTS_DIR / "probe_gqa_cache_dtypes.json",
               {"machine": machine_info(), "onnxruntime": ort.__version__, "rows": rows})


if __name__ == "__main__":
    main()
