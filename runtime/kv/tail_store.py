"""TailStore: the keys of each block still filling, unrounded (per-block key scales).

A layer that scales keys per channel within each block can only quantize a block once it
is full; until then its keys wait here in float32, one row per block (see contract). A
sequence needs the row of the block it continues, and after a speculative step the rows
of every block that step wrote (verification may keep fewer tokens and continue an
earlier block). Rows of blocks before the one a step continues, and of blocks freed, are
released.
"""

from __future__ import annotations

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.kv.paging import step_blocks
from llmopt.runtime.kv.stores import RowStore, layer_arrays
from llmopt.runtime.manifest import KVCacheSpec


class TailStore(RowStore):
    def __init__(self, kv_cache: KVCacheSpec):
        self.block_size = kv_cache.block_size
        shapes, self.new_to_store = layer_arrays(kv_cache, "tail", self.block_size or 0,
                                                 contract.tail_name, contract.new_tail_name)
        super().__init__(shapes)

    def rows_continued(self, block_tables: list[list[int]], context_lens: np.ndarray
                       ) -> np.ndarray:
        """Each sequence's row of the block it continues; rows of its earlier blocks,
        complete and committed, are released."""
        continued = []
        for table, context in zip(block_tables, context_lens, strict=True):
            first = int(context) // self.block_size
            for block in table[:first]:
                self.forget_block(block)
            continued.append(table[first])
        return self.rows_for(continued)

    def write(self, outputs: dict[str, np.ndarray], block_tables: list[list[int]],
              context_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """Keep each sequence's step rows in the rows of the blocks they fall in."""
        bs = self.block_size
        seqs, _, blocks = step_blocks(block_tables, context_lens, query_lens, bs)
        block_rows = self.rows_for(blocks.tolist())  # the step's blocks, sequence by sequence
        first_of_seq = np.searchsorted(seqs, np.arange(len(block_tables)))
        token_seqs = np.repeat(np.arange(len(block_tables)), query_lens)
        token_steps = np.arange(len(token_seqs)) - np.repeat(np.cumsum(query_lens) - query_lens,
                                                             query_lens)
        positions = context_lens[token_seqs] + token_steps
        in_step = positions // bs - context_lens[token_seqs] // bs  # step block of each token
        rows = block_rows[first_of_seq[token_seqs] + in_step]
        for new, store in self.new_to_store.items():
            self.arrays[store][rows, positions % bs] = outputs[new][token_seqs, token_steps]
