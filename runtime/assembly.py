"""Assembling an LLMEngine from an artifact: pool size, executors, speculator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.executor import OrtExecutor
from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.manifest import KVCacheSpec, Manifest
from llmopt.runtime.paging import cdiv
from llmopt.runtime.spec.speculator import build_speculator
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

    def executor_for(graph: str, kv_cache: KVCacheSpec, max_position: int) -> OrtExecutor:
        return OrtExecutor(
            path / manifest.graphs[graph].file,
            kv_cache,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_position=max_position,
            # The draft runs on the calling thread: a second intra-op pool would spin
            # on the target's cores between steps (measured: the target's steps ran
            # 29 % slower beside a 2-thread draft session on 2 cores).
            num_threads=options.num_threads if graph == "target" else 1,
            optimization_level=options.optimization_level,
            nbits_accuracy_level=manifest.graphs[graph].nbits_accuracy_level,
        )

    kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size,
                                      config.enable_prefix_caching)
    speculator = build_speculator(
        path, manifest, kv_cache_manager, executor_for, enabled=options.speculative,
        gamma=options.num_speculative_tokens, max_batch_size=options.speculative_max_batch_size,
        adaptive=options.adaptive_speculation, drafts=options.drafts)
    return LLMEngine(
        executor_for("target", manifest.kv_cache, manifest.model.max_position),
        config,
        eos_token_ids=manifest.model.eos_token_ids,
        tokenizer=tokenizer,
        kv_cache_manager=kv_cache_manager,
        speculator=speculator,
    )
