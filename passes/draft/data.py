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

# Generic requests whose answers are the `corpus: self` n-gram corpus and the self-distillation
# prompts when no text is given: many kinds of everyday request, one answer each (greedy
# answers to a repeated prompt would repeat, counting the same n-grams again). None may
# share a topic with the benchmarks' speculation prompt mixes, which would grade the corpus
# on its own answers (tests/passes/draft/test_data.py checks the words they share).
INSTRUCTIONS = (
    # code
    "Write a Python function that flattens a nested list.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class that represents a deck of playing cards.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL statement that creates a table for library loans.",
    "Write a Python script that renames photos by the date they were taken.",
    "Write a function in C that reverses a linked list.",
    "Write a bash script that renames every .txt file in a folder to .md.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write an HTML page with a form that asks for a name and an email address.",
    "Explain what a race condition is in multithreaded programs.",
    "Write unit tests with pytest for a function that adds two numbers.",
    # explanations
    "Explain how photosynthesis works.",
    "Explain the difference between a list and a tuple in Python.",
    "Explain what recursion is, with an example.",
    "Explain how a vaccine trains the immune system.",
    "Explain what inflation is and why prices rise over time.",
    "Explain how the internet sends a message from one computer to another.",
    "Explain how the moon causes tides.",
    "Explain how a rainbow forms.",
    # questions and facts
    "What are the health benefits of regular exercise?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Who was Marie Curie and what did she discover?",
    "What causes earthquakes?",
    "How many bones are there in the human body?",
    "What is the difference between a virus and a bacterium?",
    "When did the Second World War end?",
    "What is the tallest mountain in the world, and how tall is it?",
    # how-to and advice
    "How do I make a cup of green tea?",
    "How can I improve my sleep?",
    "How do I change a flat tyre on a bicycle?",
    "Give me tips for studying for an exam.",
    "How should I prepare for a job interview?",
    "How do I start learning to play the guitar?",
    # lists and plans
    "Suggest some hobbies to try at home in the evening.",
    "Name the largest ocean and the longest river on Earth.",
    "List ten common English verbs and their past tense.",
    "Make a packing list for a weekend camping trip.",
    "Plan a three-day sightseeing trip to Rome.",
    "Suggest five names for a small coffee shop.",
    "Write a weekly workout plan for a beginner.",
    "Give me a shopping list for a week of vegetarian dinners.",
    # writing
    "Write a short poem about the ocean.",
    "Write a message inviting a neighbour to a garden party.",
    "Write a fable about a tortoise who enters a race.",
    "Write a thank-you note to a friend who helped me move house.",
    "Write a product description for a stainless steel water bottle.",
    "Write a short speech for a friend's wedding.",
    "Write a cover letter for a junior data analyst position.",
    "Write a limerick about a cat.",
    # structured output
    "Write an XML snippet for a contact card with a phone number and an address.",
    "Convert 1, 5 and 10 kilometres to miles.",
    "Write a YAML configuration for a web server with a host, a port and a log level.",
    "Give the steps of making pancakes as a numbered list.",
    "Write a CSV file with five rows of names, ages and cities.",
    # reasoning and arithmetic
    "If a train travels 60 kilometres per hour for 2.5 hours, how far does it go?",
    "What is 15 percent of 240?",
    "A shirt costs 20 dollars and is on sale for 25 percent off. What is the sale price?",
    "Compare the advantages of renting and buying a home.",
    "What are the pros and cons of working from home?",
    # rewriting
    "Rewrite this sentence in a formal tone: hey, can u send me the file asap?",
    "Translate into French: Good morning, how are you today?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Describe the water cycle.",
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
    """`count` prompts in target ids: with a text file a quarter generic instructions, the
    rest snippet tasks, every fourth snippet left raw (no template) as the measurement's
    text prompts are; without one, the instructions in turn (each once, up to 64)."""
    snippets: list[str] = []
    if text_file is not None:
        windows = text_windows(ir, text_file, snippet_tokens)
        snippets = [tokenizer.decode(w.tolist()).strip() for w in windows[:count]]
    prompts = []
    for i in range(count):
        if not snippets:
            prompts.append(_chat(tokenizer, ir, INSTRUCTIONS[i % len(INSTRUCTIONS)]))
        elif i % 4 == 0:
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
