"""SinkStore: the first `sink_tokens` keys and values of each sequence, unrounded.

A layer whose KV cache is quantized may keep its attention sinks (the first positions,
which every later query attends to heavily) in float32 beside the pool (manifest
`kv_cache.sink_tokens`, see contract). The store has one row per distinct first block:
sequences that share a cached prefix share its first block, and with it their sinks, so
a prefix-cache hit finds them here as it finds the blocks in the pool.
"""

from __future__ import annotations

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.kv.stores import RowStore, layer_arrays
from llmopt.runtime.manifest import KVCacheSpec


class SinkStore(RowStore):
    def __init__(self, kv_cache: KVCacheSpec):
        self.sink_tokens = kv_cache.sink_tokens
        shapes, self.new_to_store = layer_arrays(kv_cache, "sink", self.sink_tokens,
                                                 contract.sink_name, contract.new_sink_name)
        super().__init__(shapes)

    def write(self, outputs: dict[str, np.ndarray], rows: np.ndarray,
              context_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """Keep the step's rows at positions below `sink_tokens` (padded rows excluded)."""
        for b, row in enumerate(rows):
            first, last = int(context_lens[b]), int(context_lens[b] + query_lens[b])
            end = min(last, self.sink_tokens)
            if first >= end:
                continue
            for new, store in self.new_to_store.items():
                self.arrays[store][row, first:end] = outputs[new][b, : end - first]
