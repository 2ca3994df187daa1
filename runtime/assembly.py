"""Assembling an LLMEngine from an artifact: pool size, executors, speculator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.executors.gathered import OrtExecutor
from llmopt.runtime.executors.lanes import LaneExecutor
from llmopt.runtime.executors.step_batch import Executor
from llmopt.runtime.kv.lane_manager import LaneKVCacheManager
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.manifest import GraphSpec, KVCacheSpec, Manifest
from llmopt.runtime.native import KERNELS, require_native, unavailable_reason
from llmopt.runtime.speculative.speculator import build_speculator
from llmopt.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineOptions:
    """What a user may set when loading an artifact; None takes the manifest's default."""

    num_threads: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_context: int | None = None
    enable_prefix_caching: bool = True
    optimization_level: str = "all"
    speculative: bool = True
    num_speculative_tokens: int | None = None
    speculative_max_batch_size: int | None = None
    adaptive_speculation: bool = True
    drafts: str = "all"
    draft_tree: bool = False  # suffix n-gram drafts as trees (needs an executor that runs them)
    kernels: str = "auto"  # native where it runs, else ONNX Runtime | "native" | "onnxruntime"


def kv_cache_manager_for(manifest: Manifest, config: EngineConfig) -> KVCacheManager:
    """Lanes when any graph of the artifact reads its KV in place; free placement else."""
    layouts = {manifest.kv_cache.layout}
    if manifest.speculative is not None and manifest.speculative.model is not None:
        layouts.add(manifest.speculative.model.kv_cache.layout)
    if "lanes" in layouts:
        return LaneKVCacheManager(config.num_blocks, config.block_size,
                                  cdiv(config.max_context, config.block_size),
                                  config.enable_prefix_caching)
    return KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)


def make_executor(graph_path: Path, kv_cache: KVCacheSpec, *, num_blocks: int,
                  block_size: int, lane_blocks: int | None, max_position: int,
                  num_threads: int | None = None, optimization_level: str = "all",
                  nbits_accuracy_level: int = 0) -> Executor:
    """The ONNX Runtime executor for a graph's KV layout (lanes need the lane size)."""
    common = {"num_blocks": num_blocks, "block_size": block_size, "num_threads": num_threads,
              "optimization_level": optimization_level,
              "nbits_accuracy_level": nbits_accuracy_level}
    if kv_cache.layout == "lanes":
        if lane_blocks is None:
            raise ValueError("a lanes-layout graph needs a lane size")
        return LaneExecutor(graph_path, kv_cache, lane_blocks=lane_blocks, **common)
    return OrtExecutor(graph_path, kv_cache, max_position=max_position, **common)


def graph_executor(artifact: Path, graph: GraphSpec, kv_cache: KVCacheSpec, *, kernels: str,
                   num_blocks: int, block_size: int, lane_blocks: int | None,
                   max_position: int, num_threads: int | None = None,
                   optimization_level: str = "all") -> Executor:
    """The executor `kernels` puts a graph of the artifact on: the native step (see
    `runs_native`) or ONNX Runtime's executor for its KV layout."""
    lane_tokens = lane_blocks * block_size if lane_blocks is not None else None
    if runs_native(kernels, graph, kv_cache, lane_tokens):
        from llmopt.runtime.executors.native import NativeLaneExecutor

        return NativeLaneExecutor(artifact, graph, kv_cache, num_blocks=num_blocks,
                                  block_size=block_size, lane_blocks=lane_blocks,
                                  num_threads=num_threads, max_position=max_position)
    return make_executor(artifact / graph.file, kv_cache, num_blocks=num_blocks,
                         block_size=block_size, lane_blocks=lane_blocks,
                         max_position=max_position, num_threads=num_threads,
                         optimization_level=optimization_level,
                         nbits_accuracy_level=graph.nbits_accuracy_level)


def kernels_name(executor: Executor) -> str:
    """Which kernels an executor runs: "native" (llmopt's step) or "onnxruntime"."""
    from llmopt.runtime.executors.native import NativeLaneExecutor

    return "native" if isinstance(executor, NativeLaneExecutor) else "onnxruntime"


def runs_native(kernels: str, graph: GraphSpec, kv_cache: KVCacheSpec,
                lane_tokens: int | None = None) -> bool:
    """Whether `kernels` puts this graph on the native step (its lanes `lane_tokens` long);
    `native` where it cannot run is a one-line error that says why."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: {kernels!r} is not one of {', '.join(KERNELS)}")
    if kernels == "native":
        require_native(graph, kv_cache, lane_tokens)
    return kernels == "native" or (
        kernels == "auto" and unavailable_reason(graph, kv_cache, lane_tokens) is None)


def engine_config(manifest: Manifest, options: EngineOptions) -> EngineConfig:
    """The engine's limits: the options over the manifest's runtime defaults (checks the
    pool size before any pool is allocated)."""
    defaults = manifest.runtime
    block_size = options.block_size or defaults.block_size
    max_context = options.max_context or defaults.max_context
    max_num_seqs = options.max_num_seqs or defaults.max_num_seqs
    if max_context > manifest.model.max_position:
        raise ValueError(
            f"max_context {max_context} exceeds the {manifest.model.max_position} "
            "positions the graph's rotary tables cover"
        )
    fixed = manifest.kv_cache.block_size
    if fixed is not None and block_size != fixed:
        raise ValueError(f"block_size {block_size}: the artifact's per-block key scales were "
                         f"built for blocks of {fixed}")
    if manifest.kv_cache.sink_tokens > block_size:  # a shared first block shares them all
        raise ValueError(f"block_size {block_size} is below the artifact's "
                         f"{manifest.kv_cache.sink_tokens} sink tokens (they live with a "
                         "sequence's first block)")
    num_blocks = options.num_blocks
    if num_blocks is None:
        num_blocks = defaults.num_blocks or max_num_seqs * cdiv(max_context, block_size) + 1
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens or defaults.max_num_batched_tokens,
        max_context=max_context,
        enable_prefix_caching=options.enable_prefix_caching,
    )


def build_engine(path: Path, manifest: Manifest, tokenizer: Tokenizer,
                 options: EngineOptions) -> LLMEngine:
    config = engine_config(manifest, options)
    kv_cache_manager = kv_cache_manager_for(manifest, config)

    def executor_for(graph: str, kv_cache: KVCacheSpec, max_position: int) -> Executor:
        spec = manifest.graphs[graph]
        # The draft runs on the calling thread: a second intra-op pool would spin
        # on the target's cores between steps (measured: the target's steps ran
        # 29 % slower beside a 2-thread draft session on 2 cores).
        threads = options.num_threads if graph == "target" else 1
        # `native` insists on the target; a draft graph takes it where it can run
        kernels = "auto" if options.kernels == "native" and graph != "target" else options.kernels
        executor = graph_executor(
            path, spec, kv_cache, kernels=kernels, num_blocks=config.num_blocks,
            block_size=config.block_size,
            lane_blocks=getattr(kv_cache_manager, "lane_blocks", None),
            max_position=max_position, num_threads=threads,
            optimization_level=options.optimization_level)
        if isinstance(kv_cache_manager, LaneKVCacheManager):
            kv_cache_manager.copy_listeners.append(executor.copy_block)
        if hasattr(executor, "forget_block"):  # it keeps rows per block (sinks, tails)
            kv_cache_manager.block_pool.reuse_listeners.append(executor.forget_block)
            kv_cache_manager.block_pool.release_listeners.append(executor.release_block)
        return executor

    target = executor_for("target", manifest.kv_cache, manifest.model.max_position)
    if options.draft_tree and not getattr(target, "tree_attention", False):
        raise ValueError(f"draft_tree needs a target that runs draft trees (the native "
                         f"step); this one runs on {kernels_name(target)}")
    speculator = build_speculator(
        path, manifest, kv_cache_manager, executor_for, enabled=options.speculative,
        gamma=options.num_speculative_tokens, max_batch_size=options.speculative_max_batch_size,
        adaptive=options.adaptive_speculation, drafts=options.drafts, tree=options.draft_tree)
    return LLMEngine(
        target,
        config,
        eos_token_ids=manifest.model.eos_token_ids,
        tokenizer=tokenizer,
        kv_cache_manager=kv_cache_manager,
        speculator=speculator,
    )
