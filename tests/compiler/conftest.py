"""Compiler test fixtures: one loaded IR and HF model per architecture, and a paged driver.

Every supported architecture (a row of `FAMILIES`) is tested; `tiny_checkpoints` must
have a checkpoint for each, so adding a family without a tiny config fails loudly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmopt.compiler.architectures import FAMILIES
from llmopt.compiler.ir import ArchSpec, ModelIR
from llmopt.compiler.kv_layout import cache_tensors, kv_cache_spec
from llmopt.compiler.loader import load_checkpoint
from llmopt.runtime import contract as C
from llmopt.runtime.kv.paging import step_blocks
from llmopt.runtime.kv.pools import SinkStore, TailStore
from llmopt.runtime.manifest import KVCacheSpec

# Test modules share helpers by name (`from test_lower import ...`) under importlib mode.
sys.path.insert(0, str(Path(__file__).parent))

ARCHS = sorted(FAMILIES)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine their spin
    waits make the suite several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def load_ir(tiny_checkpoints):
    """arch -> its tiny checkpoint's ModelIR, loaded once per session. Do not mutate it."""
    cache: dict[str, ModelIR] = {}

    def load(name: str) -> ModelIR:
        if name not in cache:
            cache[name] = load_checkpoint(str(tiny_checkpoints[name]))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def ir(arch, load_ir) -> ModelIR:
    return load_ir(arch)


@pytest.fixture(scope="session")
def hf_model(arch, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.float32).eval()


@pytest.fixture
def save_checkpoint(tmp_path):
    """Save a random HF checkpoint (config + weights, no tokenizer) from config settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def save(settings: dict, name: str = "model") -> Path:
        config = AutoConfig.for_model(**settings)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
        return tmp_path / name

    return save


@pytest.fixture
def paged_driver():
    """PagedDriver class: `paged_driver(session, arch)`."""
    return PagedDriver


class PagedDriver:
    """Runs a lowered decoder step by step over numpy block pools, as the runtime does.

    Blocks come from a shuffled free list, so block tables are non-contiguous and the
    sequences' blocks interleave. Pools start as random values, standing in for stale
    blocks and the null block: anything the graph's mask fails to hide changes logits.
    """

    def __init__(self, session, arch: ArchSpec, block_size: int = 4, num_blocks: int = 64):
        rng = np.random.default_rng(0)
        self.session, self.block_size = session, block_size
        self.pools: dict[str, np.ndarray] = {}
        self.new_to_past: dict[str, str] = {}
        self.block_to_past: dict[str, str] = {}
        for i, spec in enumerate(arch.layers):
            for t in cache_tensors(spec):
                past = C.past_name(i, t["name"])
                if t.get("per") == "block":  # per-block key scales: whole blocks
                    shape = (num_blocks, *t["slot_shape"])
                    self.block_to_past[C.new_block_name(i, t["name"])] = past
                else:
                    shape = (num_blocks, block_size, *t["slot_shape"])
                    self.new_to_past[C.new_name(i, t["name"])] = past
                self.pools[past] = rng.standard_normal(shape).astype(t["dtype"])
        # What quantized layers keep unrounded beside the pool: the runtime's stores.
        kv_cache = KVCacheSpec.model_validate(kv_cache_spec(arch, "blocks"))
        assert kv_cache.block_size in (None, block_size)
        self.sinks, self.tails = SinkStore(kv_cache), TailStore(kv_cache)
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        self.block_tables: dict[int, list[int]] = {}
        self.context_lens: dict[int, int] = {}

    def step(self, queries: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """Feed each sequence's query tokens; returns logits [len(tokens), vocab] per sequence."""
        bs, seqs = self.block_size, list(queries)
        for seq in seqs:
            self._allocate(seq, self.context_lens.get(seq, 0) + len(queries[seq]))
        num_seqs, max_query = len(seqs), max(len(t) for t in queries.values())
        max_blocks = max(len(self.block_tables[s]) for s in seqs)
        input_ids = np.zeros((num_seqs, max_query), np.int64)
        block_tables = np.full((num_seqs, max_blocks), C.NULL_BLOCK, np.int64)
        context_lens = np.array([self.context_lens.get(s, 0) for s in seqs], np.int64)
        # Padded rows continue their sequence's positions, as the runtime feeds them.
        position_ids = context_lens[:, None] + np.arange(max_query)
        slots = np.full((num_seqs, max_query), -1, np.int64)
        rows = []
        for b, seq in enumerate(seqs):
            n, table = len(queries[seq]), np.array(self.block_tables[seq])
            input_ids[b, :n] = queries[seq]
            block_tables[b, : len(table)] = table
            slots[b, :n] = table[position_ids[b, :n] // bs] * bs + position_ids[b, :n] % bs
            rows.append(b * max_query + np.arange(n))
        feeds = {
            C.INPUT_IDS: input_ids, C.POSITION_IDS: position_ids, C.BLOCK_TABLES: block_tables,
            C.CONTEXT_LENS: context_lens, C.LOGITS_INDICES: np.concatenate(rows), **self.pools,
        }
        if C.LOCAL_BLOCK_TABLES in {i.name for i in self.session.get_inputs()}:
            feeds[C.LOCAL_BLOCK_TABLES] = block_tables  # local layers' pools: the same ids
        tables = [self.block_tables[s] for s in seqs]
        if self.sinks:
            sink_rows = self.sinks.rows_for([table[0] for table in tables])
            feeds.update(self.sinks.arrays, **{C.SINK_ROWS: sink_rows})
        if self.tails:
            feeds[C.TAIL_ROWS] = self.tails.rows_continued(tables, context_lens)
            feeds.update(self.tails.arrays)
        names = [o.name for o in self.session.get_outputs()]
        outputs = dict(zip(names, self.session.run(names, feeds), strict=True))
        self._write(outputs, slots.ravel())
        query_lens = np.array([len(queries[s]) for s in seqs])
        self._write_blocks(outputs, tables, context_lens, query_lens)
        if self.sinks:
            self.sinks.write(outputs, sink_rows, context_lens, query_lens)
        if self.tails:
            self.tails.write(outputs, tables, context_lens, query_lens)
        for seq in seqs:
            self.context_lens[seq] = self.context_lens.get(seq, 0) + len(queries[seq])
        splits = np.cumsum([len(queries[s]) for s in seqs])[:-1]
        return dict(zip(seqs, np.split(outputs[C.LOGITS], splits), strict=True))

    def _allocate(self, seq: int, num_tokens: int) -> None:
        table = self.block_tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())

    def _write_blocks(self, outputs, tables, context_lens, query_lens) -> None:
        """Per-block tensors: the step's blocks from the continued one, as far as reached."""
        seqs, steps, block_ids = step_blocks(tables, context_lens, query_lens, self.block_size)
        for name, past in self.block_to_past.items():
            self.pools[past][block_ids] = outputs[name][seqs, steps]

    def _write(self, outputs: dict[str, np.ndarray], slots: np.ndarray) -> None:
        keep = slots >= 0  # padded query rows are never written
        for name, past in self.new_to_past.items():
            pool, new = self.pools[past], outputs[name]
            assert new.dtype == pool.dtype, f"{name} is {new.dtype}, its pool {pool.dtype}"
            slot_shape = pool.shape[2:]
            pool.reshape(-1, *slot_shape)[slots[keep]] = new.reshape(-1, *slot_shape)[keep]
