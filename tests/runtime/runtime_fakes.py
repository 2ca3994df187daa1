"""Fakes for the runtime tests: a model that genuinely reads its KV pool, and a tokenizer.

FakeModel stores every token id into a "key" pool at the token's slot and computes the
logits of a row from a rolling hash of ALL earlier tokens, which it reads back from the
pool through the block table, plus the step's own tokens. A wrong block table, a bad
prefix-cache hit or state lost in a preemption therefore changes the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tokenizers
from tokenizers import models, pre_tokenizers

from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.manifest import TokenizerSpec
from llmopt.runtime.output import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.tokenizer import Tokenizer

VOCAB_SIZE = 64
_MODULUS = (1 << 61) - 1


def history_hash(token_ids: Sequence[int]) -> int:
    """Order-sensitive hash of a token history: what FakeModel computes per row."""
    h = 17
    for token in token_ids:
        h = (h * 1_000_003 + int(token) + 1) % _MODULUS
    return h


def extend_hash(h: int, token: int) -> int:
    return (h * 1_000_003 + int(token) + 1) % _MODULUS


def fake_logits(h: int) -> np.ndarray:
    """Deterministic, peaked logits for a history hash: greedy and sampling both matter."""
    rng = np.random.default_rng(h)
    logits = rng.standard_normal(VOCAB_SIZE).astype(np.float32) * 2.0
    logits[h % VOCAB_SIZE] += 3.0
    return logits


class FakeModel:
    """An Executor over a numpy pool [num_blocks, block_size] of token ids (-1 = never written)."""

    def __init__(self, num_blocks: int, block_size: int,
                 logits_fn: Callable[[int], np.ndarray] = fake_logits,
                 bigram: Callable[[int], int] | None = None):
        """`bigram`: a row's argmax is bigram(its token) instead (a target whose greedy
        continuation a test controls; the row still reads the whole history)."""
        self.block_size = block_size
        self.logits_fn = logits_fn  # history hash -> logits row
        self.bigram = bigram
        self.pool = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.num_steps = 0
        self.step_sizes: list[int] = []

    def execute(self, batch: StepBatch) -> np.ndarray:
        self.num_steps += 1
        self.step_sizes.append(int(sum(batch.query_lens)))
        bs = self.block_size
        flat = self.pool.reshape(-1)
        row_hashes: list[int] = []
        for b, tokens in enumerate(batch.token_ids):
            context_len = batch.context_lens[b]
            table = np.asarray(batch.block_tables[b], dtype=np.int64)
            positions = np.arange(context_len + len(tokens))
            slots = table[positions // bs] * bs + positions % bs
            assert (table[: len(table)] != 0).all(), "block 0 is reserved"
            start = int(batch.query_start[b])
            np.testing.assert_array_equal(
                slots[context_len:], batch.slot_mapping[start : start + len(tokens)]
            )
            history = flat[slots[:context_len]]
            assert (history >= 0).all(), "read a slot no step has written"
            context = history_hash(history)
            parents = (batch.query_parents[b] if batch.query_parents is not None else None)
            hashes: list[int] = []
            for i, token in enumerate(tokens):  # a tree's token follows its parent
                parent = i - 1 if parents is None else parents[i]
                hashes.append(extend_hash(hashes[parent] if parent >= 0 else context, token))
            row_hashes += hashes
        # Like a real graph, the step's entries reach the pool only after the step.
        flat[batch.slot_mapping] = step_tokens = np.concatenate(batch.token_ids)
        rows = [self._logits(row_hashes[i], int(step_tokens[i])) for i in batch.logits_indices]
        return np.stack(rows) if rows else np.zeros((0, VOCAB_SIZE), np.float32)

    def _logits(self, h: int, token: int) -> np.ndarray:
        logits = self.logits_fn(h)
        if self.bigram is not None:
            logits = logits.copy()
            logits[self.bigram(token)] = logits.max() + 1.0
        return logits

    tree_attention = True

    def move_entries(self, block_table: list[int], sources: list[int],
                     destinations: list[int]) -> None:
        table, bs = np.asarray(block_table), self.block_size
        flat = self.pool.reshape(-1)
        slots = [table[np.asarray(p) // bs] * bs + np.asarray(p) % bs
                 for p in (sources, destinations)]
        flat[slots[1]] = flat[slots[0]]

    def tokens_at(self, slots: np.ndarray) -> np.ndarray:
        """The token ids the pool holds at `slots` (-1: never written)."""
        return self.pool.reshape(-1)[slots]


def make_word_tokenizer(spec: TokenizerSpec | None = None) -> Tokenizer:
    """A word-level tokenizer: "<s>"=0, "</s>"=1, "[UNK]"=2, then "w3".."w63"."""
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB_SIZE)})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    spec = spec or TokenizerSpec(file="tokenizer.json", bos_token="<s>", eos_token="</s>")
    return Tokenizer(tok, spec)


def run_engine(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[RequestOutput]:
    """Add every prompt, step until all finish, return outputs in prompt order."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
    return drain(engine, ids)


def drain(engine: LLMEngine, request_ids: Sequence[str]) -> list[RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[i] for i in request_ids]


def make_engine(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 32,
    max_context: int = 64,
    enable_prefix_caching: bool = True,
    eos_token_ids: Sequence[int] = (),
    tokenizer: Tokenizer | None = None,
) -> LLMEngine:
    """An LLMEngine over a FakeModel; the model is `engine.executor`."""
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context=max_context,
        enable_prefix_caching=enable_prefix_caching,
    )
    model = FakeModel(num_blocks, block_size)
    return LLMEngine(model, config, eos_token_ids=eos_token_ids, tokenizer=tokenizer)


def reference_greedy(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What greedy decoding of FakeModel must give, computed without any engine."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(np.argmax(fake_logits(history_hash(tokens)))))
    return tokens[len(prompt) :]


def random_prompt(n: int, seed: int = 0) -> list[int]:
    """n random token ids of a tiny model's vocabulary (past its special tokens)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens, with their log-probs."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
