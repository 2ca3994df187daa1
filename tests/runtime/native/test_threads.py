"""ThreadGovernor: as many threads as free cores, dropping at once, climbing back slowly."""

from __future__ import annotations

from llmopt.runtime.native.threads import (
    CHECK_INTERVAL_S,
    FREE_READINGS,
    SLOW_FACTOR,
    ThreadGovernor,
    runnable_tasks,
)


class Machine:
    """A clock and a count of runnable tasks that the test moves by hand."""

    def __init__(self, running: int):
        self.now, self.tasks = 0.0, running

    def clock(self) -> float:
        return self.now

    def running(self) -> int:
        return self.tasks

    def later(self) -> None:
        self.now += CHECK_INTERVAL_S * 1.01  # past the interval whatever the rounding


def governor(machine: Machine, max_threads: int = 2, cores: int = 2) -> ThreadGovernor:
    return ThreadGovernor(max_threads, clock=machine.clock, running=machine.running,
                          cores=cores)


def test_free_cores_get_every_thread_asked_for():
    machine = Machine(running=2)  # our two threads, nothing else
    gov = governor(machine)
    for _ in range(10):
        assert gov.choose(1) == 2
        gov.observe(1, 2, 0.003)
        machine.later()


def test_a_neighbour_drops_a_thread_at_the_next_reading_and_its_exit_restores_it():
    machine = Machine(running=2)
    gov = governor(machine)
    assert gov.choose(1) == 2
    machine.tasks, machine.now = 3, machine.now + 0.01  # a neighbour wakes
    assert gov.choose(1) == 2  # not read again before the interval
    machine.later()
    assert gov.choose(1) == 1
    machine.tasks = 1  # the neighbour left: only our reader runs
    picks = []
    for _ in range(FREE_READINGS + 1):
        machine.later()
        picks.append(gov.choose(1))
    assert picks == [1] * (FREE_READINGS - 1) + [2, 2]


def test_a_step_far_slower_than_its_size_s_fastest_drops_a_thread_at_once():
    machine = Machine(running=2)
    gov = governor(machine)
    gov.observe(1, 2, 0.003)
    gov.observe(8, 2, 0.010)
    gov.observe(1, 2, 0.003 * (SLOW_FACTOR - 0.5))  # slower, within what a step may vary
    assert gov.choose(1) == 2
    gov.observe(1, 2, 0.003 * (SLOW_FACTOR + 1))
    assert gov.choose(1) == 1


def test_more_cores_give_as_many_threads_as_are_free():
    machine = Machine(running=8)
    gov = governor(machine, max_threads=8, cores=16)
    assert gov.choose(1) == 8
    machine.tasks = 8 + 12  # twelve neighbours on sixteen cores: four free
    machine.later()
    assert gov.choose(1) == 4


def test_fixed_or_single_threads_never_change():
    machine = Machine(running=9)
    fixed = ThreadGovernor(2, adaptive=False, clock=machine.clock, running=machine.running,
                           cores=2)
    single = governor(machine, max_threads=1)
    for gov in (fixed, single):
        gov.observe(1, gov.choose(1), 1.0)
        gov.observe(1, gov.choose(1), 100.0)
        machine.later()
    assert fixed.choose(1) == 2 and single.choose(1) == 1


def test_runnable_tasks_counts_at_least_this_reader():
    assert runnable_tasks() >= 1
