"""The batch-1 decode bound of a memory-bound model: read bandwidth and bytes per token.

A batch-1 decode step streams every weight it multiplies by once; the bound is
bandwidth / bytes. Tensors that are only indexed by token id or position (the embedding
table, rotary caches) cost one row per token; a tied embedding that is also the LM head is
read whole. KV-cache reads grow with the context and are reported separately, per position.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import build_c_probe, probe_values

READ_PROBE = Path(__file__).parent / "probes" / "probe_read_rate.c"
READ_PROBE_FLAGS = ["-O2", "-fopenmp"]

# (op type, input index) of ONNX inputs read one row per token: indexed by id or position.
GATHERED_INPUTS = {
    ("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2),
    ("GatherBlockQuantized", 3), ("RotaryEmbedding", 2), ("RotaryEmbedding", 3),
    ("GroupQueryAttention", 7), ("GroupQueryAttention", 8),
}
MATMUL_OPS = ("MatMul", "MatMulNBits", "Gemm", "DequantizeLinear")
LLAMA_CPP_KV_BYTES = 2  # llama.cpp's default KV cache type is F16


def read_bandwidth_gb_s(threads: int, mib: int, repeats: int) -> list[float]:
    """GB/s of `repeats` sums over a `mib` MiB float64 array split across `threads` threads
    (numpy releases the GIL in reductions, so the threads read in parallel)."""
    import numpy as np

    data = np.ones(mib * 2**20 // 8)  # written once, so every page is resident
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        return _timed_reads(data.nbytes, repeats, lambda: sum(pool.map(np.sum, parts)),
                            data.size)


def _timed_reads(nbytes: int, repeats: int, read: Callable[[], Any], expected: Any
                 ) -> list[float]:
    """GB/s of each of `repeats` calls of `read` over `nbytes`, each checked to return
    `expected` (so no read can be skipped)."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = read()
        samples.append(nbytes / (time.perf_counter() - started) / 1e9)
        assert result == expected
    return samples


def native_read_bandwidth_gb_s(threads: int, mib: int, repeats: int) -> list[float] | None:
    """GB/s of `repeats` reads of a `mib` MiB array by a loop like the native step's weight
    stream (probes/probe_read_rate.c: 64-byte loads, prefetched ahead; split over `threads`),
    or None where the probe cannot run (no C compiler, or a CPU without AVX-512)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            binary = build_c_probe(READ_PROBE, READ_PROBE_FLAGS, Path(tmp))
        except (SystemExit, subprocess.CalledProcessError):
            return None
        result = subprocess.run([str(binary), str(mib), str(threads), str(repeats)],
                                capture_output=True, text=True)
    if result.returncode or len(result.stdout.split()) < 2:
        return None
    return list(probe_values(result.stdout).values())


# ---- bytes per decode token ----------------------------------------------------------


def onnx_weight_bytes(model_path: Path) -> dict[str, float]:
    """Bytes of initializers one decode token reads, by the op type that consumes them
    (one row of an initializer that is only gathered)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in inits:
                uses.setdefault(name, []).append((node.op_type, index))
    by_op: dict[str, float] = {}
    for name, consumers in uses.items():
        tensor = inits[name]
        nbytes = _tensor_bytes(tensor)
        read_whole = [op for op, index in consumers if (op, index) not in GATHERED_INPUTS]
        if read_whole:  # e.g. a tied embedding: gathered, and the LM head's MatMul
            op = next((o for o in read_whole if o in MATMUL_OPS), read_whole[0])
        else:
            op, nbytes = f"{consumers[0][0]} (one row)", nbytes / max(1, tensor.dims[0])
        by_op[op] = by_op.get(op, 0.0) + nbytes
    return by_op


def _tensor_bytes(tensor: Any) -> float:
    import math

    import onnx

    dtype = tensor.data_type
    four_bit = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
    itemsize = 0.5 if dtype in four_bit else onnx.helper.tensor_dtype_to_np_dtype(dtype).itemsize
    return itemsize * math.prod(tensor.dims)


def gguf_weight_bytes(path: Path) -> dict[str, float]:
    """Bytes of GGUF tensors one decode token reads, by quantization type (the token
    embedding one row, unless it is also the output head: no `output.weight`)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    by_type: dict[str, float] = {}
    for t in tensors:
        nbytes = float(t.n_bytes)
        kind = t.tensor_type.name
        if t.name == "token_embd.weight" and not tied:
            nbytes, kind = nbytes * int(t.shape[0]) / t.n_elements, f"{kind} (one row)"
        by_type[kind] = by_type.get(kind, 0.0) + nbytes
    return by_type


def gguf_kv_bytes_per_position(path: Path) -> float:
    """K and V bytes one context position adds to every layer (F16 cache)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].contents())

    head_dim = field("embedding_length") // field("attention.head_count")
    kv_heads = field("attention.head_count_kv")
    return 2 * field("block_count") * kv_heads * head_dim * LLAMA_CPP_KV_BYTES


def llmopt_model_file(artifact: Path) -> Path:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return artifact / manifest["graphs"]["target"]["file"]


def llmopt_kv_bytes_per_position(artifact: Path) -> float:
    """Bytes of every KV tensor slot (all layers) in the artifact's manifest."""
    import numpy as np

    manifest = json.loads((artifact / "manifest.json").read_text())
    return float(sum(np.dtype(t["dtype"]).itemsize * int(np.prod(t["slot_shape"]))
                     for layer in manifest["kv_cache"]["layers"] for t in layer["tensors"]))


def ort_genai_model_file(model_dir: Path) -> Path:
    config = json.loads((model_dir / "genai_config.json").read_text())
    return model_dir / config["model"]["decoder"]["filename"]


def ort_genai_kv_bytes_per_position(model_dir: Path) -> float:
    """K and V bytes per position from genai_config's decoder shape and the dtype of the
    model's `past_key_values.0.key` input (its head size is a symbolic dim)."""
    import onnx

    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    graph = onnx.load(str(ort_genai_model_file(model_dir)), load_external_data=False).graph
    past = next(v for v in graph.input if v.name == "past_key_values.0.key")
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(past.type.tensor_type.elem_type).itemsize
    return float(2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"]
                 * decoder["head_size"] * itemsize)
