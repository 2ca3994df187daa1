"""HugePageArena: copies that read back exactly, each on a cache line, packed in order."""

from __future__ import annotations

import numpy as np

from llmopt.runtime.native.arena import ALIGN, HUGE_PAGE, HugePageArena


def test_placed_arrays_hold_the_same_values_in_c_order() -> None:
    rng = np.random.default_rng(0)
    arena = HugePageArena()
    sources = [rng.integers(0, 255, (3, 5, 7), dtype=np.uint8),
               rng.standard_normal((40, 17)).astype(np.float32).T,  # not contiguous
               rng.integers(-9, 9, 1000, dtype=np.int32)]
    placed = [arena.place(a) for a in sources]
    for source, copy in zip(sources, placed, strict=True):
        assert copy.shape == source.shape and copy.dtype == source.dtype
        assert copy.flags.c_contiguous
        np.testing.assert_array_equal(copy, source)
        assert copy.ctypes.data % ALIGN == 0


def test_arrays_follow_each_other_from_a_huge_page_boundary() -> None:
    arena = HugePageArena()
    first = arena.place(np.ones(100, np.uint8))
    second = arena.place(np.ones(10, np.float32))
    assert first.ctypes.data % HUGE_PAGE == 0  # a mapping's first array starts its huge page
    assert second.ctypes.data == first.ctypes.data + 2 * ALIGN  # 100 bytes: two lines


def test_a_full_mapping_is_followed_by_a_new_one_and_nothing_is_overwritten() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    arrays = [np.full(HUGE_PAGE * 3 // 8, i, np.uint8) for i in range(5)]  # two a mapping
    big = np.arange(HUGE_PAGE // 2, dtype=np.float32)  # more than a chunk: its own mapping
    placed = [arena.place(a) for a in arrays] + [arena.place(big)]
    for source, copy in zip([*arrays, big], placed, strict=True):
        np.testing.assert_array_equal(copy, source)
    assert len(arena._mappings) == 4
