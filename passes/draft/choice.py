"""Choose γ for a draft pairing: run the measurements of `measure` on the lowered
graphs, then pick the γ that maximises the expected speedup at the first batch size,
the largest batch size where speculation still pays, and the manifest's records.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import numpy as np

from llmopt.compiler.ir import ModelIR
from llmopt.passes.draft.distill import text_windows
from llmopt.passes.draft.measure import (
    NgramLookup,
    PagedRunner,
    SimulatedSteps,
    StepCosts,
    Trajectory,
    draft_agreement,
    greedy_trajectories,
    measure_costs,
    position_acceptance,
    run_lengths,
    simulate,
)
from llmopt.runtime.executors.step_batch import Executor
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.manifest import TokenizerSpec
from llmopt.runtime.speculative.cost_model import (
    best_gamma,
    expected_tokens_per_position,
    model_step_cost,
)
from llmopt.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class MeasureSettings:
    prompts: list[list[int]]
    new_tokens: int
    batch_sizes: list[int]
    context_len: int
    repeats: int
    max_gamma: int
    gamma: int | None  # fixed by the recipe; None: choose
    ngram: NgramLookup | None  # the n-gram drafter's lookup, when it drafts first
    min_speedup: float
    block_size: int
    eos_ids: tuple[int, ...]


def measure(target: Executor, draft: Executor | None, token_map: np.ndarray | None,
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
    measured = _measured_record(costs, choice, settings, trajectories, trajectory_seconds,
                                started)
    if draft is not None and settings.ngram is not None:  # each half alone, for comparison
        measured["model_only"] = _summary(_choose(trajectories, costs, replace(settings,
                                                                                ngram=None)))
        no_model = [Trajectory(t.tokens, t.prompt_len) for t in trajectories]
        measured["ngram_only"] = _summary(_choose(no_model, costs, settings))
    return _spec(choice, costs, settings, measured)


def ngram_alone_pays_more(spec: dict) -> bool:
    """Whether the n-gram drafts alone were predicted faster at the first batch size than
    with the draft model as their fallback (a draft model dearer than it returns)."""
    alone = spec["measured"].get("ngram_only")
    return alone is not None and alone["predicted_speedup"][0] > spec["predicted_speedup"]


def without_model(spec: dict) -> dict:
    """The pairing's fields for n-gram drafts alone (`ngram_only`), the model's kept in
    `measured` for the record."""
    alone = spec["measured"]["ngram_only"]
    return {**spec, "gamma": alone["gamma"], "max_batch_size": alone["max_batch_size"],
            "acceptance": alone["acceptance"], "cost_ratio": 0.0,
            "predicted_speedup": alone["predicted_speedup"][0]}


def _spec(choice: Choice, costs: StepCosts, settings: MeasureSettings,
          measured: dict) -> dict:
    first = settings.batch_sizes[0]
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
        return alphas, [expected_tokens_per_position(alphas, g) for g in gammas], {}
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


CHAT_PROMPTS = (
    "Why is the sky blue?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Repeat this list back to me in alphabetical order: pear, apple, fig, banana, cherry.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Fix the grammar: 'me and him goes to the store yesterday and buyed apples.'",
)


def calibration_prompts(ir: ModelIR, count: int, text_file: str | None,
                        text_tokens: int = 64) -> list[list[int]]:
    """`count` prompts in target ids, alternating chat-style requests (through the chat
    template when there is one) and openings of the calibration text's LAST windows
    (distillation trains on the first ones)."""
    tokenizer = target_tokenizer(ir)
    chat = [tokenizer.encode_chat([{"role": "user", "content": p}]) if ir.chat_template
            else tokenizer.encode(p) for p in CHAT_PROMPTS]
    text: list[list[int]] = []
    if text_file is not None:
        windows = text_windows(ir, text_file, text_tokens)
        text = [w.tolist() for w in windows[-count:]]
    mixed = [p for pair in itertools.zip_longest(chat, text) for p in pair if p is not None]
    return (mixed * count)[:count]


def target_tokenizer(ir: ModelIR) -> Tokenizer:
    """The runtime's tokenizer for `ir`, chat template and BOS handling included."""
    tokens = ir.annotations.get("tokens", {})
    spec = ir.tokenizer_spec or TokenizerSpec(file="tokenizer.json",
                                              bos_token=tokens.get("bos_token"),
                                              eos_token=tokens.get("eos_token"))
    return Tokenizer(ir.text_tokenizer(), spec)
