"""ThreadGovernor: how many threads each native step runs, from the cores free right now.

A step's threads meet at barriers many times. On free cores they spin there and win; when
a neighbour takes a core, a thread waiting for a descheduled partner burns its time slice
at every barrier and the step falls far below one thread's speed (sleeping at barriers
instead costs the free machine more than it gains). So the threads keep spinning, and the
governor runs only as many as there are free cores: it reads the number of runnable tasks
(/proc/loadavg) a few times a second, drops at once when neighbours appear or a step turns
out far slower than the fastest seen at its size, and climbs back once the cores have
stayed free for a few readings.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

ADAPTIVE_VARIABLE = "LLMOPT_NATIVE_ADAPTIVE_THREADS"  # "0": always the thread count asked for
CHECK_INTERVAL_S = 0.2  # between readings of the runnable tasks
FREE_READINGS = 3  # consecutive readings with more free cores before adding threads
SLOW_FACTOR = 4.0  # a step this much slower than its size's fastest means lost cores


def runnable_tasks() -> int:
    """Tasks running or waiting for a CPU, machine-wide, this reader included."""
    with open("/proc/loadavg") as loadavg:
        return int(loadavg.read().split()[3].split("/")[0])


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


class ThreadGovernor:
    """Chooses each step's thread count, 1 up to `max_threads`, from the free cores."""

    def __init__(self, max_threads: int, adaptive: bool = True,
                 clock: Callable[[], float] = time.perf_counter,
                 running: Callable[[], int] = runnable_tasks, cores: int | None = None):
        self.max_threads = max(1, max_threads)
        self.adaptive = adaptive and self.max_threads > 1
        self.threads = self.max_threads
        self.clock, self.running = clock, running
        self.cores = cores or available_cores()
        self.checked_at = -math.inf
        self.free_readings = 0
        self.fastest: dict[tuple[int, int], float] = {}  # (size class, threads) -> seconds

    def choose(self, rows: int) -> int:
        """The thread count for the next step (of `rows` query rows)."""
        if self.adaptive and self.clock() - self.checked_at >= CHECK_INTERVAL_S:
            self.checked_at = self.clock()
            self._read_free_cores()
        return self.threads

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds` on `threads` threads."""
        if not self.adaptive or threads == 1:
            return
        key = (rows.bit_length(), threads)
        fastest = self.fastest.get(key, math.inf)
        self.fastest[key] = min(fastest, seconds)
        if seconds > SLOW_FACTOR * fastest:  # a partner thread lost its core mid-step
            self._set(threads - 1)

    def _read_free_cores(self) -> None:
        # our own threads count as running: they spin between steps while several run
        neighbours = max(0, self.running() - self.threads)
        wanted = max(1, min(self.max_threads, self.cores - neighbours))
        if wanted < self.threads:
            self._set(wanted)
        elif wanted > self.threads:
            self.free_readings += 1
            if self.free_readings >= FREE_READINGS:
                self._set(wanted)

    def _set(self, threads: int) -> None:
        self.threads, self.free_readings = max(1, threads), 0
