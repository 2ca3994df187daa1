"""The one place that chooses what runs a graph of the artifact: the native step where
`kernels` allows it, else ONNX Runtime's executor for the graph's KV layout."""

from __future__ import annotations

from pathlib import Path

from llmopt.runtime.executors.gathered import OrtExecutor
from llmopt.runtime.executors.lanes import LaneExecutor
from llmopt.runtime.executors.step_batch import Executor
from llmopt.runtime.kv.pools import BlockPools, KVPools, LanePools, make_pools
from llmopt.runtime.manifest import GraphSpec, KVCacheSpec
from llmopt.runtime.native import KERNELS, require_native, unavailable_reason


def make_executor(graph_path: Path, kv_cache: KVCacheSpec, *, num_blocks: int,
                  block_size: int, lane_blocks: int | None, max_position: int,
                  num_threads: int | None = None, optimization_level: str = "all",
                  nbits_accuracy_level: int = 0) -> Executor:
    """The ONNX Runtime executor for a graph's KV layout, over new pools (lanes need the
    lane size)."""
    pools = make_pools(kv_cache, num_blocks=num_blocks, block_size=block_size,
                       lane_blocks=lane_blocks)
    return ort_executor(graph_path, pools, max_position=max_position, num_threads=num_threads,
                        optimization_level=optimization_level,
                        nbits_accuracy_level=nbits_accuracy_level)


def ort_executor(graph_path: Path, pools: KVPools, *, max_position: int,
                 num_threads: int | None = None, optimization_level: str = "all",
                 nbits_accuracy_level: int = 0) -> Executor:
    """ONNX Runtime's executor for the layout of `pools`."""
    common = {"num_threads": num_threads, "optimization_level": optimization_level,
              "nbits_accuracy_level": nbits_accuracy_level}
    if isinstance(pools, LanePools):
        return LaneExecutor(graph_path, pools, **common)
    assert isinstance(pools, BlockPools)
    return OrtExecutor(graph_path, pools, max_position=max_position, **common)


def graph_executor(artifact: Path, graph: GraphSpec, kv_cache: KVCacheSpec, *, kernels: str,
                   num_blocks: int, block_size: int, lane_blocks: int | None,
                   max_position: int, num_threads: int | None = None,
                   optimization_level: str = "all",
                   num_local_blocks: int | None = None) -> Executor:
    """The executor `kernels` puts a graph of the artifact on, over new pools: the native
    step (see `runs_native`) or ONNX Runtime's executor for its KV layout."""
    native = runs_native(kernels, graph, kv_cache)
    pools = make_pools(kv_cache, num_blocks=num_blocks, block_size=block_size,
                       lane_blocks=lane_blocks, num_local_blocks=num_local_blocks)
    if native:
        from llmopt.runtime.executors.native import NativeLaneExecutor

        return NativeLaneExecutor(artifact, graph, pools, num_threads=num_threads,
                                  max_position=max_position)
    return ort_executor(artifact / graph.file, pools, max_position=max_position,
                        num_threads=num_threads, optimization_level=optimization_level,
                        nbits_accuracy_level=graph.nbits_accuracy_level)


def kernels_name(executor: Executor) -> str:
    """Which kernels an executor runs: "native" (llmopt's step) or "onnxruntime"."""
    from llmopt.runtime.executors.native import NativeLaneExecutor

    return "native" if isinstance(executor, NativeLaneExecutor) else "onnxruntime"


def runs_native(kernels: str, graph: GraphSpec, kv_cache: KVCacheSpec) -> bool:
    """Whether `kernels` puts this graph on the native step;
    `native` where it cannot run is a one-line error that says why."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: {kernels!r} is not one of {', '.join(KERNELS)}")
    if kernels == "native":
        require_native(graph, kv_cache)
    return kernels == "native" or (
        kernels == "auto" and unavailable_reason(graph, kv_cache) is None)
