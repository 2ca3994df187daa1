"""Measure a draft and choose γ: greedy acceptance on the target's own greedy
continuations, step costs of the lowered graphs under ONNX Runtime, and the expected
speedup per γ and batch size.

Greedy acceptance needs no draft loop: with teacher forcing along the target's greedy
trajectory, the draft's proposal at t is accepted for exactly as long as its argmax
agrees with the trajectory from t on (an accepted draft token IS the target's token).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from llmopt.runtime.executor import OrtExecutor
from llmopt.runtime.kv_cache_manager import cdiv
from llmopt.runtime.step_batch import StepBatch


# --- the formula ------------------------------------------------------------------------
def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """Tokens per target step with γ drafts: 1 + Σ_{i≤γ} Π_{j≤i} α_j (the bonus/correction
    token, plus each draft token accepted only if all before it were)."""
    total, survive = 1.0, 1.0
    for alpha in alphas[:gamma]:
        survive *= alpha
        total += survive
    return total


def best_gamma(tokens_per_step: Sequence[float], cost_per_step: Sequence[float]
               ) -> tuple[int, float]:
    """(γ, speedup) maximising tokens/cost; entry γ-1 is γ's (costs in target steps)."""
    speedups = [t / c for t, c in zip(tokens_per_step, cost_per_step, strict=True)]
    best = max(range(len(speedups)), key=lambda i: speedups[i])
    return best + 1, speedups[best]


def model_step_cost(gamma: int, draft: float, verify: float) -> float:
    """One speculative step in target steps: γ draft steps plus a (γ+1)-token verify."""
    return gamma * draft + verify


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


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    (max_n down to min_n tokens): prompt lookup, as the runtime's n-gram drafter does."""
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, array.size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)
        hits = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return array[start : start + k].tolist()
    return []


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


def simulate(trajectories: list[Trajectory], gamma: int,
             ngram: tuple[int, int] | None) -> SimulatedSteps:
    """Walk each trajectory as the runtime would: n-gram proposal first when it matches,
    else the draft model's (when there is one), else a plain step."""
    steps = SimulatedSteps()
    for traj in trajectories:
        t = traj.prompt_len
        while t < len(traj.tokens):
            proposal = ngram_lookup(traj.tokens[:t], *ngram, gamma) if ngram else []
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
    """Drives an OrtExecutor over disjoint per-sequence block ranges (no block manager)."""

    def __init__(self, executor: OrtExecutor, block_size: int, blocks_per_seq: int):
        self.executor, self.block_size, self.blocks_per_seq = executor, block_size, blocks_per_seq

    def step(self, queries: list[list[int]], starts: list[int], seqs: list[int] | None = None,
             all_logits: bool = False) -> np.ndarray:
        """Feed queries[b] at positions starts[b].. of sequence seqs[b] (default b); logits
        of each query's last row, or of every row."""
        seqs = list(range(len(queries))) if seqs is None else seqs
        tables = [self._table(s) for s in seqs]
        slots = [self._slots(table, start, len(q))
                 for table, start, q in zip(tables, starts, queries, strict=True)]
        ends = np.cumsum([len(q) for q in queries])
        rows = np.arange(ends[-1]) if all_logits else ends - 1
        batch = StepBatch(queries, list(starts), tables, np.concatenate(slots),
                          rows.astype(np.int64))
        return self.executor.execute(batch)

    def _table(self, seq: int) -> list[int]:
        first = 1 + seq * self.blocks_per_seq  # block 0 is the null block
        return list(range(first, first + self.blocks_per_seq))

    def _slots(self, table: list[int], start: int, n: int) -> np.ndarray:
        positions = np.arange(start, start + n)
        return np.asarray(table)[positions // self.block_size] * self.block_size + (
            positions % self.block_size)


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
def step_seconds(executor: OrtExecutor, batch_size: int, query_len: int, context: int,
                 block_size: int, repeats: int) -> float:
    """Fastest wall time (contention only ever adds) of one step: batch_size sequences of
    `context` cached tokens each taking `query_len` new ones, logits for every query row
    (as verification needs)."""
    runner = PagedRunner(executor, block_size, cdiv(context + query_len, block_size))
    queries = [[3 + (b + i) % 50 for i in range(query_len)] for b in range(batch_size)]
    starts = [context] * batch_size
    runner.step(queries, starts, all_logits=True)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.step(queries, starts, all_logits=True)
        times.append(time.perf_counter() - started)
    return min(times)


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


def measure_costs(target: OrtExecutor, draft: OrtExecutor | None, batch_sizes: list[int],
                  max_gamma: int, context: int, block_size: int, repeats: int) -> StepCosts:
    """Target steps of 1..max_gamma+1 tokens at the first batch size (the runtime sizes
    drafts from them), of a few lengths at the others (interpolated between), and draft
    1-token steps, at every batch size."""
    every, few = range(1, max_gamma + 2), sorted({1, 2, 3, 5, max_gamma + 1})
    target_costs = {b: {n: step_seconds(target, b, n, context, block_size, repeats)
                        for n in (every if b == batch_sizes[0] else few)}
                    for b in batch_sizes}
    draft_costs = None if draft is None else {
        b: step_seconds(draft, b, 1, context, block_size, repeats) for b in batch_sizes}
    return StepCosts(target_costs, draft_costs)


# --- putting it together ----------------------------------------------------------------
@dataclass(frozen=True)
class MeasureSettings:
    prompts: list[list[int]]
    new_tokens: int
    batch_sizes: list[int]
    context_len: int
    repeats: int
    max_gamma: int
    gamma: int | None  # fixed by the recipe; None: choose
    ngram: tuple[int, int] | None  # (min_n, max_n) when n-gram lookup drafts first
    min_speedup: float
    block_size: int
    eos_ids: tuple[int, ...]


def measure(target: OrtExecutor, draft: OrtExecutor | None, token_map: np.ndarray | None,
            settings: MeasureSettings) -> dict:
    """SpeculativeSpec fields (gamma, max_batch_size, acceptance, cost_ratio,
    predicted_speedup, measured) from acceptance on greedy trajectories and step costs."""
    started = time.perf_counter()
    longest = max(len(p) for p in settings.prompts) + settings.new_tokens
    runner = PagedRunner(target, settings.block_size, cdiv(longest, settings.block_size))
    trajectories = greedy_trajectories(runner, settings.prompts, settings.new_tokens,
                                       settings.eos_ids)
    if draft is not None:
        draft_runner = PagedRunner(draft, settings.block_size, runner.blocks_per_seq)
        trajectories = [Trajectory(t.tokens, t.prompt_len,
                                   draft_agreement(draft_runner, t, token_map))
                        for t in trajectories]
    trajectory_seconds = time.perf_counter() - started
    costs = measure_costs(target, draft, settings.batch_sizes, settings.max_gamma,
                          settings.context_len, settings.block_size, settings.repeats)
    choice = _choose(trajectories, costs, settings)
    first = settings.batch_sizes[0]
    measured = _measured_record(costs, choice, settings, trajectories, trajectory_seconds,
                                started)
    if draft is not None and settings.ngram is not None:  # each half alone, for comparison
        measured["model_only"] = _summary(_choose(trajectories, costs, replace(settings,
                                                                                ngram=None)))
        no_model = [Trajectory(t.tokens, t.prompt_len) for t in trajectories]
        measured["ngram_only"] = _summary(_choose(no_model, costs, settings))
    return {
        "gamma": choice.gamma,
        "max_batch_size": choice.max_batch_size,
        "acceptance": [round(a, 4) for a in choice.acceptance],
        "cost_ratio": round(costs.draft[first] / costs.target[first][1], 4)
        if costs.draft else 0.0,
        "predicted_speedup": round(choice.speedups[0], 3),
        # verify_cost[k]: a (k+1)-token target step over a 1-token one, at the first batch size
        "verify_cost": [round(costs.verify(first, k + 1) / costs.target[first][1], 4)
                        for k in range(settings.max_gamma + 1)],
        "measured": measured,
    }


@dataclass(frozen=True)
class Choice:
    acceptance: list[float]  # α per draft position
    tokens: list[float]  # tokens per step, γ = 1..max
    step_costs: dict[int, list[float]]  # batch size -> step cost in target steps, per γ
    gamma: int
    speedups: list[float]  # per batch size, at γ
    max_batch_size: int
    extra: dict


def _choose(trajectories: list[Trajectory], costs: StepCosts,
            settings: MeasureSettings) -> Choice:
    """γ maximising the expected speedup at the first batch size (or the recipe's γ)."""
    sims = None if settings.ngram is None else [
        simulate(trajectories, g, settings.ngram) for g in range(1, settings.max_gamma + 1)]
    acceptance, tokens, extra = _acceptance(trajectories, sims, settings)
    per_batch = {b: _step_costs(sims, costs, b, settings) for b in settings.batch_sizes}
    gamma = settings.gamma or best_gamma(tokens, per_batch[settings.batch_sizes[0]])[0]
    speedups = [tokens[gamma - 1] / per_batch[b][gamma - 1] for b in settings.batch_sizes]
    return Choice(acceptance, tokens, per_batch, gamma, speedups,
                  _max_batch_size(settings.batch_sizes, speedups, settings.min_speedup), extra)


def _summary(choice: Choice) -> dict:
    return {"gamma": choice.gamma, "acceptance": [round(a, 4) for a in choice.acceptance],
            "predicted_speedup": [round(s, 3) for s in choice.speedups],
            "max_batch_size": choice.max_batch_size, **choice.extra}


def _acceptance(trajectories: list[Trajectory], sims: list[SimulatedSteps] | None,
                settings: MeasureSettings) -> tuple[list[float], list[float], dict]:
    """α per position, tokens per step for γ = 1..max, and extra records.

    A model-only draft uses the formula over α measured at every start position; with
    n-gram lookup the proposals vary in length and source, so the steps are simulated.
    """
    if sims is None:
        runs = np.concatenate([run_lengths(t.agree[t.prompt_len:], settings.max_gamma)
                               for t in trajectories])
        alphas = position_acceptance(runs, settings.max_gamma)
        gammas = range(1, settings.max_gamma + 1)
        return alphas, [expected_tokens(alphas, g) for g in gammas], {}
    widest = sims[-1]
    extra = {"ngram_match_rate": round(widest.sources.count("ngram") / len(widest.sources), 4),
             "simulated_tokens_per_step": [round(s.tokens_per_step(), 4) for s in sims]}
    return widest.acceptance(settings.max_gamma), [s.tokens_per_step() for s in sims], extra


def _step_costs(sims: list[SimulatedSteps] | None, costs: StepCosts, batch: int,
                settings: MeasureSettings) -> list[float]:
    """Mean cost of a speculative step, in target 1-token steps, for γ = 1..max."""
    plain = costs.target[batch][1]
    draft = costs.draft[batch] / plain if costs.draft else 0.0
    out = []
    for gamma in range(1, settings.max_gamma + 1):
        if sims is None:
            out.append(model_step_cost(gamma, draft, costs.verify(batch, gamma + 1) / plain))
            continue
        sim = sims[gamma - 1]
        step = {"ngram": lambda n: costs.verify(batch, n + 1) / plain,
                "model": lambda n: model_step_cost(n, draft, costs.verify(batch, n + 1) / plain),
                "none": lambda n: 1.0}
        out.append(float(np.mean([step[s](n) for s, n in zip(sim.sources, sim.proposed,
                                                             strict=True)])))
    return out


def _max_batch_size(batch_sizes: list[int], speedups: list[float], threshold: float) -> int:
    """The largest batch size up to which every measured one is predicted to pay."""
    best = 0
    for batch, speedup in zip(batch_sizes, speedups, strict=True):
        if speedup < threshold:
            break
        best = batch
    return best


def _measured_record(costs: StepCosts, choice: Choice, settings: MeasureSettings,
                     trajectories: list[Trajectory], trajectory_seconds: float,
                     started: float) -> dict:
    sizes, gamma = settings.batch_sizes, choice.gamma
    ms = {b: {n: 1000 * s for n, s in costs.target[b].items()} for b in sizes}
    common = sorted(set.intersection(*(set(ms[b]) for b in sizes)))
    return {
        "batch_sizes": sizes,
        "context_len": settings.context_len,
        "target_step_ms": [round(ms[b][1], 3) for b in sizes],
        "verify_step_ms": {str(n): [round(ms[b][n], 3) for b in sizes] for n in common},
        "draft_step_ms": [round(1000 * costs.draft[b], 3) for b in sizes] if costs.draft else None,
        # a (γ+1)-token verification against γ+1 single-token steps: < 1 is what pays
        "verify_cost_ratio": [round(costs.verify(b, gamma + 1) / ((gamma + 1) * ms[b][1] / 1000),
                                    4) for b in sizes],
        "draft_cost_ratio": [round(costs.draft[b] / costs.target[b][1], 4) for b in sizes]
        if costs.draft else None,
        "predicted_speedup": [round(s, 3) for s in choice.speedups],
        "tokens_per_step": [round(t, 4) for t in choice.tokens],
        "speedup_by_gamma": [round(t / c, 3) for t, c in zip(
            choice.tokens, choice.step_costs[sizes[0]], strict=True)],
        "prompts": len(trajectories),
        "continuation_tokens": sum(len(t.tokens) - t.prompt_len for t in trajectories),
        "trajectory_seconds": round(trajectory_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
        **choice.extra,
    }
