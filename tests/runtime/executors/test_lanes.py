"""The lanes executor's call planning and inputs (the graph itself: tests/test_end_to_end.py)."""

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.executors.inputs import lane_inputs
from llmopt.runtime.executors.lanes import plan_calls
from llmopt.runtime.executors.step_batch import SequenceStep, make_step_batch


def test_decodes_share_one_call_across_idle_lanes_and_prefills_split_on_them():
    assert plan_calls([0, 2, 5], [1, 1, 1], [9, 9, 9], 512) == [[0, 1, 2]]
    # two idle 64-token rows: too many
    assert plan_calls([0, 3], [64, 64], [0, 0], 512) == [[0], [1]]
    assert plan_calls([0, 1], [64, 64], [0, 0], 512) == [[0, 1]]
    assert plan_calls([0, 1], [1, 300], [9, 0], 512) == [[1], [0]]  # a decode beside a chunk


def test_a_row_whose_padded_chunk_would_overrun_its_lane_runs_alone():
    # A 4-token verification at context 69 padded to 29 rows would end at 98 > 96.
    assert plan_calls([0, 1], [4, 29], [69, 10], 96) == [[0], [1]]
    assert plan_calls([0, 1], [4, 29], [60, 10], 96) == [[0, 1]]


def test_inputs_put_each_sequence_in_its_lanes_row_and_leave_the_others_idle():
    batch = make_step_batch([SequenceStep([7, 8, 9], 5, [9, 10], [2]),
                             SequenceStep([4], 20, [1, 2, 3, 4, 5, 6], [0])], block_size=4)
    inputs = lane_inputs(batch, rows=[2, 0], num_rows=3)
    np.testing.assert_array_equal(inputs[contract.INPUT_IDS], [[4, 0, 0], [0, 0, 0], [7, 8, 9]])
    np.testing.assert_array_equal(inputs[contract.QUERY_SEQLENS], [1, 0, 3])
    np.testing.assert_array_equal(inputs[contract.SEQLENS_K], [20, 0, 7])
    assert int(inputs[contract.TOTAL_SEQUENCE_LENGTH]) == 21
    np.testing.assert_array_equal(inputs[contract.LOGITS_INDICES], [8, 0])  # rows 2*3+2, 0
