"""Memory for the native step's repacked weights, on huge pages where the kernel gives them.

A batch-1 step streams every matrix once per token. Each matrix in its own array sat on
4 KiB pages, scattered over the heap: a stream that misses the TLB every 4 KiB and whose
hardware prefetch stops at every page boundary. In a few large mappings advised for
transparent huge pages (2 MiB), in the order the step reads them, the same loop streams
the weights faster (benchmarks/README.md). Where the kernel has no transparent huge
pages (or another OS), the arrays are still contiguous, in read order.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # one mapping's size, unless an array needs more
ALIGN = 64  # every array starts on a cache line


class HugePageArena:
    """Copies of arrays, packed one after another into private anonymous mappings."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self._chunk_bytes = chunk_bytes
        self._mappings: list[mmap.mmap] = []  # kept alive: the arrays are views of them
        self._free: np.ndarray = np.empty(0, np.uint8)  # what is left of the last mapping

    def place(self, array: np.ndarray) -> np.ndarray:
        """`array`'s contents in the arena (C order), as an array of its shape and dtype."""
        nbytes = array.nbytes
        padded = -(-nbytes // ALIGN) * ALIGN
        if padded > self._free.size:
            self._free = self._map(max(padded, self._chunk_bytes))
        placed = self._free[:nbytes].view(array.dtype).reshape(array.shape)
        placed[...] = array
        self._free = self._free[padded:]
        return placed

    def _map(self, nbytes: int) -> np.ndarray:
        """A new mapping of at least `nbytes`, from its first huge-page boundary on."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; a no-op where THP is off
            mapping.madvise(mmap.MADV_HUGEPAGE)
        self._mappings.append(mapping)
        memory = np.frombuffer(mapping, np.uint8)
        start = -memory.ctypes.data % HUGE_PAGE
        return memory[start:start + size - HUGE_PAGE]
