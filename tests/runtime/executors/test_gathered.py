import numpy as np
import pytest
from toy_artifact import VOCAB, build_artifact, manifest_dict, next_token

from llmopt.runtime.executors.gathered import OrtExecutor
from llmopt.runtime.executors.inputs import contract_inputs
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.pools import BlockPools
from llmopt.runtime.manifest import KVCacheSpec


def batch_of(token_ids, context_lens, block_tables, slots, logits_indices) -> StepBatch:
    return StepBatch(
        token_ids=token_ids,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=np.asarray(slots, dtype=np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
    )


def test_contract_inputs_pad_right_and_map_packed_rows():
    # Seq 0: 5 cached tokens in blocks [3, 7], decodes 1 more into block 7.
    # Seq 1: a fresh 3-token prefill into block 2.
    batch = batch_of(
        token_ids=[[11], [21, 22, 23]],
        context_lens=[5, 0],
        block_tables=[[3, 7], [2]],
        slots=[7 * 4 + 1, 8, 9, 10],
        logits_indices=[0, 3],
    )
    inputs, slots = contract_inputs(batch, block_size=4, max_position=100)
    np.testing.assert_array_equal(inputs["input_ids"], [[11, 0, 0], [21, 22, 23]])
    np.testing.assert_array_equal(inputs["position_ids"], [[5, 6, 7], [0, 1, 2]])
    np.testing.assert_array_equal(inputs["block_tables"], [[3, 7], [2, 0]])
    np.testing.assert_array_equal(inputs["context_lens"], [5, 0])
    np.testing.assert_array_equal(inputs["logits_indices"], [0, 5])  # rows of [B*S]
    np.testing.assert_array_equal(slots, [29, -1, -1, 8, 9, 10])
    assert all(a.dtype == np.int64 for a in inputs.values())


def test_contract_inputs_trim_tables_to_the_cached_context_and_clip_positions():
    batch = batch_of([[1, 2], [3]], [0, 0], [[1, 4], [2]], [4, 5, 8], [])
    inputs, _ = contract_inputs(batch, block_size=4, max_position=2)
    np.testing.assert_array_equal(inputs["position_ids"], [[0, 1], [0, 1]])
    np.testing.assert_array_equal(inputs["block_tables"], [[1], [2]])  # at least one column
    np.testing.assert_array_equal(inputs["logits_indices"], [0])  # a placeholder row


@pytest.fixture(scope="module")
def executor(tmp_path_factory) -> OrtExecutor:
    path = build_artifact(tmp_path_factory.mktemp("toy"))
    spec = KVCacheSpec.model_validate(manifest_dict()["kv_cache"])
    return OrtExecutor(
        path / "model.onnx", BlockPools(spec, num_blocks=8, block_size=4), max_position=256,
        num_threads=1)


def test_executor_writes_the_pool_in_place_and_reads_it_back(executor):
    key, value = executor.pools["past.0.key"], executor.pools["past.0.value"]
    assert key.shape == (8, 4, 1) and key.dtype == np.float32
    assert value.shape == (8, 4, 2) and value.dtype == np.float16

    prompt = [5, 9, 13, 17, 21, 25]  # blocks [6, 2]: slots 24..27, 8, 9
    slots = [24, 25, 26, 27, 8, 9]
    logits = executor.execute(batch_of([prompt], [0], [[6, 2]], slots, [5]))
    assert logits.shape == (1, VOCAB) and logits.dtype == np.float32
    assert int(logits.argmax()) == next_token(prompt)
    np.testing.assert_array_equal(key.reshape(-1)[slots], prompt)
    np.testing.assert_array_equal(value.reshape(-1, 2)[slots], np.c_[prompt, range(6)])
    assert np.count_nonzero(key) == 6  # nothing else was written

    # A decode and a second, padded sequence in one step: the decode reads its 6 cached
    # tokens through the block table; padded rows are never written.
    batch = batch_of([[30], [7, 8]], [6, 0], [[6, 2], [5]], [10, 20, 21], [0, 2])
    logits = executor.execute(batch)
    assert logits.argmax(-1).tolist() == [next_token([*prompt, 30]), next_token([7, 8])]
    assert np.count_nonzero(key) == 9
    np.testing.assert_array_equal(key.reshape(-1)[[10, 20, 21]], [30, 7, 8])


def test_executor_rejects_a_graph_that_does_not_match_the_manifest(tmp_path):
    path = build_artifact(tmp_path)
    spec = KVCacheSpec.model_validate(
        {"layers": [{"tensors": [{"name": "key", "dtype": "float32", "slot_shape": [1]}]}]}
    )
    with pytest.raises(ValueError, match=r"unexpected inputs \['past.0.value'\]"):
        OrtExecutor(path / "model.onnx", BlockPools(spec, num_blocks=4, block_size=4),
                    max_position=64)


def test_unknown_optimization_level_is_an_error(tmp_path):
    path = build_artifact(tmp_path)
    spec = KVCacheSpec.model_validate(manifest_dict()["kv_cache"])
    with pytest.raises(ValueError, match="unknown graph optimization level 'fast'"):
        OrtExecutor(
            path / "model.onnx",
            BlockPools(spec, num_blocks=4, block_size=4),
            max_position=64,
            optimization_level="fast",
        )


def test_padding_groups_keep_decodes_apart_from_long_prefill_chunks():
    from llmopt.runtime.executors.ort import padding_groups

    assert padding_groups([1, 1, 1]) == [[0, 1, 2]]
    assert padding_groups([1, 512, 1, 1]) == [[1], [0, 2, 3]]
    assert padding_groups([128, 128, 100, 1]) == [[0, 1, 2], [3]]
    # a verification beside plain decodes: a few padded rows beat a second weight read
    assert padding_groups([1, 6, 1]) == [[1, 0, 2]]
    assert len(padding_groups([6] + [1] * 15)) == 2  # but not 90 padded rows
    groups = padding_groups([7, 3, 9, 9, 1, 2])
    assert sorted(i for g in groups for i in g) == list(range(6))


def test_a_mixed_step_gives_the_logits_of_separate_steps(executor):
    """Prefill chunks and decodes split into several graph calls, logits in batch order."""
    from llmopt.runtime.executors.ort import select_sequences

    batch = StepBatch(
        token_ids=[[5], [1, 2, 3, 4, 5, 6, 7, 8], [9]],
        context_lens=[0, 0, 0],
        block_tables=[[1], [2, 3], [4]],
        slot_mapping=np.array([4, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
        logits_indices=np.array([0, 8, 9]),
    )
    sub, rows = select_sequences(batch, [2, 0])
    assert sub.token_ids == [[9], [5]] and rows.tolist() == [0, 2]
    assert sub.logits_indices.tolist() == [1, 0] and sub.slot_mapping.tolist() == [16, 4]
    together = executor.execute(batch)
    # Each sequence alone (rewriting the same entries at the same slots) gives its rows.
    for seq, row in ((0, 0), (1, 1), (2, 2)):
        alone, _ = select_sequences(batch, [seq])
        np.testing.assert_array_equal(executor.execute(alone)[0], together[row])
