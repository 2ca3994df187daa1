"""Distillation data made by the target itself (`distill_data: self`).

A draft distilled on calibration text learns that text; at run time it must predict what
the TARGET writes (a chat model answering requests), so its acceptance stays low. Here
the windows are the target's own greedy continuations of prompts: calibration-text
snippets wrapped in instructions (summarize, repeat, explain, continue) and a few
generic requests (code, explanations, lists), through the chat template when there is
one. Greedy, because that is what greedy speculation verifies against; the KL to the
target's full distribution still teaches the draft the rest of it.

The prompts use the calibration text's FIRST snippets; the pass's measurement uses
openings of its LAST windows and its own chat prompts, so the two do not overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.passes.draft.distill import text_windows
from llmopt.passes.draft.measure import PagedRunner, Trajectory, greedy_trajectories
from llmopt.runtime.tokenizer import Tokenizer

INSTRUCTIONS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Explain how photosynthesis works.",
    "Explain the difference between a list and a tuple in Python.",
    "Explain what recursion is, with an example.",
    "What are the health benefits of regular exercise?",
    "Give me five ideas for a healthy breakfast.",
    "Write a short poem about the ocean.",
    "Write a polite email asking a colleague to review my report.",
    "How do I make a cup of green tea?",
    "List the planets of the solar system in order from the sun.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Describe the water cycle in simple terms.",
)
SNIPPET_TASKS = (
    "Summarize: {}",
    "Repeat exactly: {}",
    "Explain this passage in simple terms: {}",
    "Continue the following text: {}",
    "What are the key facts in this text? {}",
    "{}",  # the bare snippet through the template: the model's own reply to text
)
GENERATION_BATCH = 16  # sequences decoded together: large enough to amortise each step


@dataclass(frozen=True)
class SelfWindows:
    ids: torch.Tensor  # int64 [n, length]: prompt + continuation, padded at the end
    mask: torch.Tensor  # float [n, length]: 1 where the logits predict a continuation token
    report: dict


def self_prompts(ir: ModelIR, tokenizer: Tokenizer, count: int, text_file: str | None,
                 snippet_tokens: int = 48) -> list[list[int]]:
    """`count` prompts in target ids: a quarter generic instructions, the rest snippet
    tasks, every fourth snippet left raw (no template) as the measurement's text
    prompts are."""
    snippets: list[str] = []
    if text_file is not None:
        windows = text_windows(ir, text_file, snippet_tokens)
        snippets = [tokenizer.decode(w.tolist()).strip() for w in windows[:count]]
    prompts = []
    for i in range(count):
        if not snippets or i % 4 == 0:
            prompts.append(_chat(tokenizer, ir, INSTRUCTIONS[(i // 4) % len(INSTRUCTIONS)]))
        elif i % 4 == 3:
            prompts.append(tokenizer.encode(snippets[i % len(snippets)]))
        else:
            task = SNIPPET_TASKS[i % len(SNIPPET_TASKS)]
            prompts.append(_chat(tokenizer, ir, task.format(snippets[i % len(snippets)])))
    return prompts


def _chat(tokenizer: Tokenizer, ir: ModelIR, text: str) -> list[int]:
    if ir.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def generate(runner_for: Callable[[int], PagedRunner], prompts: list[list[int]],
             new_tokens: int, eos_ids: Sequence[int]) -> list[Trajectory]:
    """The target's greedy continuations, GENERATION_BATCH prompts at a time;
    `runner_for(blocks_per_seq)` gives a runner over the lowered target."""
    longest = max(len(p) for p in prompts) + new_tokens
    out: list[Trajectory] = []
    for start in range(0, len(prompts), GENERATION_BATCH):
        runner = runner_for(longest)
        out += greedy_trajectories(runner, prompts[start:start + GENERATION_BATCH],
                                   new_tokens, eos_ids)
    return out


def windows_from(trajectories: list[Trajectory], pad_id: int) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """(ids, mask): each trajectory right-padded to the longest (causal attention: the
    padding never reaches earlier positions), and the positions whose next token is
    part of the continuation (the loss counts only those)."""
    length = max(len(t.tokens) for t in trajectories)
    ids = torch.full((len(trajectories), length), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(trajectories), length)
    for row, traj in enumerate(trajectories):
        ids[row, : len(traj.tokens)] = torch.tensor(traj.tokens)
        mask[row, traj.prompt_len - 1 : len(traj.tokens) - 1] = 1.0
    return ids, mask


def self_windows(ir: ModelIR, tokenizer: Tokenizer, runner_for: Callable[[int], PagedRunner],
                 count: int, new_tokens: int, text_file: str | None,
                 max_len: int) -> SelfWindows:
    started = time.perf_counter()
    prompts = [p[-(max_len - new_tokens):] for p in
               self_prompts(ir, tokenizer, count, text_file)]
    trajectories = generate(runner_for, prompts, new_tokens, ir.arch.eos_token_ids)
    pad = ir.arch.eos_token_ids[0] if ir.arch.eos_token_ids else 0
    ids, mask = windows_from(trajectories, pad)
    return SelfWindows(ids, mask, {
        "data": "self", "prompts": len(prompts), "window_len": ids.shape[1],
        "prompt_tokens": sum(t.prompt_len for t in trajectories),
        "continuation_tokens": int(mask.sum()),
        "generation_seconds": round(time.perf_counter() - started, 1)})
