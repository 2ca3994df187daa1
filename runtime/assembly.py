"""Assembling an LLMEngine from an artifact: pool size, executors, speculator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.executors.choose import graph_executor, kernels_name
from llmopt.runtime.executors.step_batch import Executor
from llmopt.runtime.kv.compaction import KeyFormat, LaneMover
from llmopt.runtime.kv.h2o import H2OKV, H2OConfig
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.kv.sliding import SlidingBlocks
from llmopt.runtime.kv.streaming import StreamingConfig, StreamingKV
from llmopt.runtime.manifest import KVCacheSpec, Manifest
from llmopt.runtime.native.library import unavailable_reason
from llmopt.runtime.native.plan import NativePlan, Tensor, read_plan, rotary_tables
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
    # attention sinks + a window (`kv.streaming`) or H2O (`kv.h2o`); None: the manifest's;
    # False: off
    streaming: StreamingConfig | H2OConfig | bool | None = None


def kv_cache_manager_for(manifest: Manifest, config: EngineConfig) -> KVCacheManager:
    """Lanes when any graph of the artifact reads its KV in place; free placement else,
    with blocks of their own for the layers that read a local block table."""
    graphs = manifest.runnable_graphs()
    layouts = {graph.kv_cache.layout for graph in graphs}
    lane_blocks = cdiv(config.max_context, config.block_size) if "lanes" in layouts else None
    windows = [w for graph in graphs if (w := graph.kv_cache.local_window()) is not None]
    sliding, trails = None, False
    if windows and lane_blocks is None:
        trails = any(graph.kv_cache.local_window() for graph in graphs[1:])
        sliding = SlidingBlocks(num_local_blocks(config, max(windows), trails),
                                config.block_size, max(windows))
    manager = KVCacheManager(config.num_blocks, config.block_size,
                             config.enable_prefix_caching, lane_blocks, sliding)
    manager.sliding_trails = trails
    return manager


def num_local_blocks(config: EngineConfig, window: int, trails: bool) -> int:
    """Blocks of the local group: each running sequence's window and a step's tokens past
    it (as many as the full pool where a draft graph trails the target: its window lags)."""
    if trails:
        return config.num_blocks
    per_sequence = cdiv(window - 1 + config.max_num_batched_tokens, config.block_size) + 1
    return min(config.num_blocks, config.max_num_seqs * per_sequence + 1)


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
    step_tokens = options.max_num_batched_tokens or defaults.max_num_batched_tokens
    streaming = streaming_config(manifest, options)
    if streaming is not None:
        check_streaming(manifest, streaming, max_context, block_size)
        if isinstance(streaming, H2OConfig):
            check_h2o(manifest, options.kernels)
        step_tokens = min(step_tokens, streaming.max_step_tokens(block_size))
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=step_tokens,
        max_context=max_context,
        # a streaming request's blocks change contents as it slides: nothing to share
        enable_prefix_caching=options.enable_prefix_caching and streaming is None,
        streaming=streaming is not None,
    )


def streaming_config(manifest: Manifest, options: EngineOptions
                     ) -> StreamingConfig | H2OConfig | None:
    """The eviction the options ask for, else the recipe's (None: off)."""
    if isinstance(options.streaming, StreamingConfig | H2OConfig):
        return options.streaming
    if options.streaming is False:
        return None
    recipe, h2o = manifest.runtime.streaming, manifest.runtime.h2o
    if h2o is not None:
        return H2OConfig(budget=h2o.budget, recent=h2o.recent, sinks=h2o.sinks, drop=h2o.drop)
    if recipe is None:
        return None
    return StreamingConfig(sinks=recipe.sinks, window=recipe.window, drop=recipe.drop)


def check_h2o(manifest: Manifest, kernels: str) -> None:
    """H2O needs attention weights: the native step's, or those a graph compiled for H2O
    (`runtime: {h2o: ...}`) returns beside its fused attention on ONNX Runtime. One line
    where neither runs the target (before any work)."""
    if manifest.runtime.h2o is not None:  # its graph returns them (compiler/attention_sums)
        return
    reason = ("kernels: onnxruntime" if kernels == "onnxruntime"
              else unavailable_reason(manifest.graphs["target"], manifest.kv_cache))
    if reason is not None:
        raise ValueError(f"h2o needs attention weights: the native step's, which cannot run "
                         f"here ({reason}), or a graph compiled with `runtime: {{h2o: ...}}` "
                         f"(ONNX Runtime's fused GroupQueryAttention returns none)")


def check_streaming(manifest: Manifest, streaming: StreamingConfig | H2OConfig,
                    max_context: int, block_size: int) -> None:
    """One-line errors where an artifact or the settings cannot stream (before any work)."""
    streaming.check(max_context=max_context, block_size=block_size,
                    max_position=manifest.model.max_position)
    kv_cache = manifest.kv_cache
    if kv_cache.layout != "lanes":
        raise ValueError("streaming needs the lanes KV layout; this artifact's is "
                         f"{kv_cache.layout!r}")
    names = {t.name for layer in kv_cache.layers for t in layer.tensors}
    if not names <= {"key", "value"}:
        raise ValueError(f"streaming supports lanes of keys and values only; this artifact's "
                         f"hold {sorted(names)}")
    plan = read_plan(manifest.graphs["target"].native)
    if rotary_tables(plan) is None:
        raise ValueError("streaming needs the target's rotary tables (and how its lanes "
                         "hold keys), which this artifact's manifest does not name")
    codes = any(t.dtype in ("int8", "uint8") for layer in kv_cache.layers for t in layer.tensors)
    if codes and not isinstance(plan, NativePlan):
        raise ValueError("streaming needs the static key scales of KV codes to turn kept "
                         "keys, which only a native plan names; this artifact has none")
    if isinstance(plan, NativePlan) and any(
            layer.kv is not None and layer.kv.bits in (8, 4) and layer.kv.key_scale is None
            for layer in plan.layers):
        raise ValueError("streaming needs the static key scales of KV codes to turn kept "
                         "keys; this artifact's native plan has none")


def eviction_kv(path: Path, manifest: Manifest, policy: StreamingConfig | H2OConfig,
                manager: KVCacheManager) -> StreamingKV | H2OKV:
    """The per-request eviction state, with the target's rotary tables and key formats."""
    spec = manifest.graphs["target"]
    plan = read_plan(spec.native)
    tables = rotary_tables(plan)
    assert tables is not None, "check_streaming let a graph without rotary tables through"
    data = np.memmap(path / spec.data_file, np.uint8, mode="r") if spec.data_file else None
    formats = {}
    for index, layer in enumerate(plan.layers if isinstance(plan, NativePlan) else ()):
        kv = layer.kv
        if kv is None:
            continue
        scale = (None if kv.key_scale is None
                 else _tensor_array(kv.key_scale, data).reshape(-1, 1, plan.head_dim))
        rotation = None if kv.rotation is None else _tensor_array(kv.rotation, data)
        formats[index] = KeyFormat(kv.bits, scale, rotation)
    mover = LaneMover(*(_tensor_array(table, data) for table in tables), formats)
    block_size = manager.block_size
    if isinstance(policy, StreamingConfig):
        return StreamingKV(policy, block_size, mover)
    assert manager.lane_blocks is not None, "check_streaming let a blocks layout through"
    kv_heads = manifest.kv_cache.layers[0].tensors[0].slot_shape[0]
    return H2OKV(policy, block_size, mover, layers=len(manifest.kv_cache.layers),
                 lanes=manager.num_lanes,
                 kv_heads=kv_heads, lane_tokens=manager.lane_blocks * block_size)


def _tensor_array(tensor: Tensor, data: np.ndarray | None) -> np.ndarray:
    """A plan tensor's values, from the graph's weights file where it lies there."""
    dtype = np.dtype(tensor.dtype)
    if tensor.values is not None:
        return np.asarray(tensor.values, dtype).reshape(tensor.shape)
    assert data is not None and tensor.offset is not None and tensor.length is not None
    return np.array(data[tensor.offset:tensor.offset + tensor.length].view(dtype)
                    ).reshape(tensor.shape)


def build_engine(path: Path, manifest: Manifest, tokenizer: Tokenizer,
                 options: EngineOptions) -> LLMEngine:
    config = engine_config(manifest, options)
    kv_cache_manager = kv_cache_manager_for(manifest, config)
    streaming = streaming_config(manifest, options)
    if streaming is not None:
        kv_cache_manager.streaming = eviction_kv(path, manifest, streaming, kv_cache_manager)
    sliding = kv_cache_manager.sliding
    local_blocks = len(sliding.block_pool.blocks) if sliding is not None else None

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
            lane_blocks=kv_cache_manager.lane_blocks,
            max_position=max_position, num_threads=threads,
            optimization_level=options.optimization_level,
            num_local_blocks=local_blocks)
        kv_cache_manager.attach(executor.pools)
        return executor

    target = executor_for("target", manifest.kv_cache, manifest.model.max_position)
    if isinstance(kv_cache_manager.streaming, H2OKV):  # check_h2o saw it runs native
        target.accumulate_attention(kv_cache_manager.streaming.sums)  # type: ignore[attr-defined]
    if options.draft_tree and not getattr(target, "tree_attention", False):
        raise ValueError(f"draft_tree needs a target that runs draft trees (the native "
                         f"step); this one runs on {kernels_name(target)}")
    speculator = build_speculator(
        path, manifest, kv_cache_manager, executor_for,
        enabled=options.speculative and streaming is None,
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
