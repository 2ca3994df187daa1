"""Measuring a draft: greedy acceptance on the target's own greedy
continuations (and a simulation of n-gram lookup along them), and step costs of the
lowered graphs under ONNX Runtime.

Greedy acceptance needs no draft loop: with teacher forcing along the target's greedy
trajectory, the draft's proposal at t is accepted for exactly as long as its argmax
agrees with the trajectory from t on (an accepted draft token IS the target's token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llmopt.runtime.executors.step_batch import Executor, SequenceStep, make_step_batch
from llmopt.runtime.kv.paging import cdiv


# --- acceptance ---------------------------------------------------------------------------
def run_lengths(agree: np.ndarray, cap: int) -> np.ndarray:
    """For each start t, how many of agree[t], agree[t+1], ... are True in a row (≤ cap)."""
    out = np.zeros(len(agree), dtype=np.int64)
    run = 0
    for t in range(len(agree) - 1, -1, -1):
        run = run + 1 if agree[t] else 0
        out[t] = min(run, cap)
    return out


def position_acceptance(runs: np.ndarray, max_gamma: int) -> list[float]:
    """α_i = P(draft i accepted | drafts 1..i-1 accepted), over every start position."""
    alphas = []
    for i in range(1, max_gamma + 1):
        tried = int((runs >= i - 1).sum())
        alphas.append(float((runs >= i).sum()) / tried if tried else 0.0)
    return alphas


@dataclass(frozen=True)
class Trajectory:
    tokens: list[int]  # prompt + the target's greedy continuation
    prompt_len: int
    agree: np.ndarray | None = None  # agree[t]: the draft's argmax before t is tokens[t]


@dataclass
class SimulatedSteps:
    """Greedy speculative steps along trajectories: proposal source, length, accepted."""

    sources: list[str] = field(default_factory=list)  # "ngram" | "model" | "none"
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def tokens_per_step(self) -> float:
        return float(np.mean(self.accepted)) + 1.0

    def acceptance(self, max_gamma: int) -> list[float]:
        """α_i over steps whose proposal reached position i with 1..i-1 accepted."""
        alphas = []
        for i in range(1, max_gamma + 1):
            tried = sum(p >= i and a >= i - 1 for p, a in zip(self.proposed, self.accepted,
                                                               strict=True))
            hit = sum(a >= i for a in self.accepted)
            alphas.append(hit / tried if tried else 0.0)
        return alphas


# A fresh draft function for one growing sequence: (its tokens, k) -> up to k drafts.
NgramLookup = Callable[[], Callable[[Sequence[int], int], list[int]]]


def simulate(trajectories: list[Trajectory], gamma: int,
             ngram: NgramLookup | None) -> SimulatedSteps:
    """Walk each trajectory as the runtime would: n-gram proposal first when it matches
    (`ngram`: the runtime drafter's `lookup`), else the draft model's (when there is one),
    else a plain step."""
    steps = SimulatedSteps()
    for traj in trajectories:
        t = traj.prompt_len
        lookup = ngram() if ngram else None
        while t < len(traj.tokens):
            proposal = lookup(traj.tokens[:t], gamma) if lookup else []
            if proposal:
                truth = traj.tokens[t : t + len(proposal)]
                agree = np.array([p == x for p, x in zip(proposal, truth, strict=False)])
                source, length = "ngram", len(proposal)
            elif traj.agree is not None:
                agree, source, length = traj.agree[t : t + gamma], "model", gamma
            else:
                agree, source, length = np.zeros(0, bool), "none", 0
            accepted = int(run_lengths(agree, gamma)[0]) if len(agree) else 0
            accepted = min(accepted, len(traj.tokens) - t - 1)  # the last token is a bonus
            steps.sources.append(source)
            steps.proposed.append(length)
            steps.accepted.append(accepted)
            t += accepted + 1
    return steps


# --- running the lowered graphs ----------------------------------------------------------
class PagedRunner:
    """Drives an executor over disjoint per-sequence block ranges (no block manager:
    measurement sequences never share or free blocks). A lanes-layout executor's ranges
    are its lanes."""

    def __init__(self, executor: Executor, block_size: int, blocks_per_seq: int):
        self.executor, self.block_size = executor, block_size
        self.blocks_per_seq = getattr(executor, "lane_blocks", None) or blocks_per_seq

    def step(self, queries: list[list[int]], starts: list[int], seqs: list[int] | None = None,
             all_logits: bool = False) -> np.ndarray:
        """Feed queries[b] at positions starts[b].. of sequence seqs[b] (default b); logits
        of each query's last row, or of every row."""
        seqs = list(range(len(queries))) if seqs is None else seqs
        sequences = [
            SequenceStep(q, start, self._table(s), range(len(q)) if all_logits else [len(q) - 1])
            for q, start, s in zip(queries, starts, seqs, strict=True)]
        return self.executor.execute(make_step_batch(sequences, self.block_size))

    def _table(self, seq: int) -> list[int]:
        first = 1 + seq * self.blocks_per_seq  # block 0 is the null block
        return list(range(first, first + self.blocks_per_seq))


def greedy_trajectories(runner: PagedRunner, prompts: list[list[int]], new_tokens: int,
                        eos_ids: Sequence[int]) -> list[Trajectory]:
    """The target's greedy continuation of every prompt, decoded as one batch; a sequence
    stops at its first EOS (kept)."""
    tokens = [list(p) for p in prompts]
    logits = runner.step(tokens, [0] * len(tokens))
    live = list(range(len(tokens)))
    while live:
        for b, row in zip(live, logits, strict=True):
            tokens[b].append(int(row.argmax()))
        live = [b for b in live if tokens[b][-1] not in eos_ids
                and len(tokens[b]) < len(prompts[b]) + new_tokens]
        if live:
            logits = runner.step([[tokens[b][-1]] for b in live],
                                 [len(tokens[b]) - 1 for b in live], seqs=live)
    return [Trajectory(t, len(p)) for t, p in zip(tokens, prompts, strict=True)]


def draft_agreement(runner: PagedRunner, traj: Trajectory,
                    token_map: np.ndarray | None) -> np.ndarray:
    """agree[t] for t > prompt_len - 1: the draft's teacher-forced argmax is tokens[t]."""
    logits = runner.step([traj.tokens[:-1]], [0], all_logits=True)
    predicted = logits.argmax(-1)
    if token_map is not None:
        predicted = token_map[predicted]
    agree = np.zeros(len(traj.tokens), dtype=bool)
    agree[1:] = predicted == np.asarray(traj.tokens[1:])
    agree[: traj.prompt_len] = False  # only the continuation counts
    return agree


# --- step costs -------------------------------------------------------------------------
def timed_step(executor: Executor, batch_size: int, query_len: int, context: int,
               block_size: int) -> Callable[[], float]:
    """A function running one step and returning its wall time: batch_size sequences of
    `context` cached tokens each taking `query_len` new ones, logits for every query row
    (as verification needs)."""
    runner = PagedRunner(executor, block_size, cdiv(context + query_len, block_size))
    queries = [[3 + (b + i) % 50 for i in range(query_len)] for b in range(batch_size)]
    starts = [context] * batch_size

    def run() -> float:
        started = time.perf_counter()
        runner.step(queries, starts, all_logits=True)
        return time.perf_counter() - started

    return run


@dataclass
class StepCosts:
    """Seconds per step: target[B][n] for n query tokens per sequence, draft[B] at n = 1."""

    target: dict[int, dict[int, float]]
    draft: dict[int, float] | None

    def verify(self, batch_size: int, query_len: int) -> float:
        """Target step of `query_len` tokens, interpolated between measured lengths; a
        longer step never counts as cheaper than a shorter one (timing noise)."""
        measured = self.target[batch_size]
        lens = sorted(measured)
        seconds = np.maximum.accumulate([measured[n] for n in lens])
        return float(np.interp(query_len, lens, seconds))


def measure_costs(target: Executor, draft: Executor | None, batch_sizes: list[int],
                  max_gamma: int, context: int, block_size: int, rounds: int) -> StepCosts:
    """Target steps of 1..max_gamma+1 tokens at the first batch size (the runtime sizes
    drafts from them), of a few lengths at the others (interpolated between), and draft
    1-token steps, at every batch size.

    Each configuration runs once per round and keeps its fastest time: contention only
    ever adds, and interleaving spreads a burst of load over all configurations.
    """
    every, few = range(1, max_gamma + 2), sorted({1, 2, 3, 5, max_gamma + 1})
    steps = {("target", b, n): timed_step(target, b, n, context, block_size)
             for b in batch_sizes for n in (every if b == batch_sizes[0] else few)}
    if draft is not None:
        steps |= {("draft", b, 1): timed_step(draft, b, 1, context, block_size)
                  for b in batch_sizes}
    for run in steps.values():
        run()  # warm-up
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for key, run in steps.items():
            best[key] = min(best[key], run())
    target_costs = {b: {n: t for (kind, bb, n), t in best.items() if kind == "target" and bb == b}
                    for b in batch_sizes}
    draft_costs = None if draft is None else {b: best[("draft", b, 1)] for b in batch_sizes}
    return StepCosts(target_costs, draft_costs)
