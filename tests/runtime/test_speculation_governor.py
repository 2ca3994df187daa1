from __future__ import annotations

from llmopt.runtime.speculation_governor import SpeculationGovernor


def run(governor: SpeculationGovernor, batch: int, steps: int, spec_s: float, plain_s: float,
        tokens_per_spec_step: int = 2) -> int:
    """Drive `steps` decode steps; returns how many speculated."""
    speculated = 0
    for _ in range(steps):
        if governor.allows(batch):
            speculated += 1
            governor.record(batch, True, spec_s, tokens_per_spec_step * batch)
        else:
            governor.record(batch, False, plain_s, batch)
    return speculated


def test_speculation_that_pays_keeps_running_with_rare_plain_probes():
    governor = SpeculationGovernor(probe_every=16)
    assert run(governor, 1, 160, spec_s=0.012, plain_s=0.010) >= 140  # 6 ms vs 10 ms a token


def test_speculation_slower_than_plain_is_paused_and_retried():
    governor = SpeculationGovernor(probe_every=16, pause_steps=40)
    speculated = run(governor, 8, 200, spec_s=0.030, plain_s=0.010)  # 15 ms vs 10 ms
    assert 0 < speculated <= 16  # a few probes of 3 steps each, 40 steps apart


def test_batch_size_buckets_decide_separately():
    governor = SpeculationGovernor(probe_every=16, pause_steps=40)
    run(governor, 16, 100, spec_s=0.050, plain_s=0.020)  # slower at batch 16
    assert run(governor, 1, 50, spec_s=0.012, plain_s=0.010) >= 40  # still pays at batch 1
    assert governor.buckets[(16).bit_length()].paused_until > 0
