"""SinkStore: a row of unrounded first positions per distinct first block."""

from __future__ import annotations

import numpy as np

from llmopt.runtime import contract as C
from llmopt.runtime.kv.pools import SinkStore, pool_array
from llmopt.runtime.manifest import KVCacheSpec


def store(sink_tokens: int = 3, width: int = 4) -> SinkStore:
    sink = [{"name": n, "dtype": "float32", "slot_shape": [width]} for n in ("key", "value")]
    codes = [{"name": n, "dtype": "int8", "slot_shape": [width]} for n in ("key", "value")]
    return SinkStore(KVCacheSpec.model_validate({
        "layers": [{"tensors": codes, "sink": sink}, {"tensors": codes}],  # layer 1: none
        "sink_tokens": sink_tokens}))


def step_outputs(batch: int, rows: int, width: int = 4, offset: float = 0.0) -> dict:
    values = offset + np.arange(batch * rows * width, dtype=np.float32)
    return {C.new_sink_name(0, n): values.reshape(batch, rows, width) * (1 if n == "key" else -1)
            for n in ("key", "value")}


def test_only_layers_with_sinks_have_arrays():
    sinks = store()
    assert set(sinks.arrays) == {C.sink_name(0, "key"), C.sink_name(0, "value")}
    assert not SinkStore(KVCacheSpec.model_validate({"layers": [{"tensors": []}]}))


def test_a_step_keeps_only_positions_below_sink_tokens():
    sinks = store()
    rows = sinks.rows_for([7, 9])
    # sequence 0 starts at position 1 with 3 rows (positions 1..3), sequence 1 at 3 (none)
    sinks.write(step_outputs(2, 3), rows, np.array([1, 3]), np.array([3, 1]))
    keys = sinks.arrays[C.sink_name(0, "key")]
    np.testing.assert_array_equal(keys[rows[0], 1:3], step_outputs(2, 3)[
        C.new_sink_name(0, "key")][0, :2])
    assert not keys[rows[0], 0].any() and not keys[rows[1]].any()


def test_rows_follow_first_blocks_and_are_freed_with_them():
    sinks = store()
    first = sinks.rows_for([5, 6, 5])
    assert first[0] == first[2] != first[1]
    sinks.forget_block(5)
    assert 5 not in sinks.row_of_block and sinks.rows_for([8])[0] == first[0]  # reused
    sinks.forget_block(123)  # a block that never held sinks


def test_the_store_grows_and_says_so():
    sinks = store()
    sinks.write(step_outputs(1, 3), sinks.rows_for([1]), np.array([0]), np.array([3]))
    before = sinks.arrays[C.sink_name(0, "key")][sinks.row_of_block[1]].copy()
    rows = sinks.rows_for(list(range(1, 20)))
    assert len(set(rows.tolist())) == 19 and sinks.grown
    assert sinks.arrays[C.sink_name(0, "key")].shape[0] >= 19
    np.testing.assert_array_equal(sinks.arrays[C.sink_name(0, "key")][rows[0]], before)


def test_a_copied_first_block_brings_its_sinks():
    sinks = store()
    sinks.write(step_outputs(1, 3, offset=1), sinks.rows_for([2]), np.array([0]), np.array([3]))
    sinks.copy_block(2, 11)
    for array in sinks.arrays.values():
        np.testing.assert_array_equal(array[sinks.row_of_block[11]],
                                      array[sinks.row_of_block[2]])
    sinks.copy_block(4, 12)  # no sinks there: nothing to bring
    assert 12 not in sinks.row_of_block


def test_pool_arrays_are_zeroed_writable_and_independent():
    a, b = pool_array((3, 2, 4), np.int8), pool_array([5], "float32")
    assert a.shape == (3, 2, 4) and a.dtype == np.int8 and not a.any()
    assert b.shape == (5,) and b.dtype == np.float32 and a.flags.c_contiguous
    a[1, 1] = 7
    assert a.sum() == 28 and not b.any()
