"""Constrained generation through the engine, on a tiny random model: every output obeys
its constraint, and neither batching nor speculation changes a constrained greedy output."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.request import Request
from llmopt.runtime.scheduler import ScheduledRequest
from llmopt.runtime.speculative.constrained import mask_draft_rows
from llmopt.runtime.structured import StructuredOutputsParams
from llmopt.runtime.structured.compiler import GrammarError
from llmopt.runtime.structured.masks import allow_all, fill_mask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "size": {"enum": ["small", "large"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False},
}, "required": ["name", "size", "tags", "inner"], "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"(cat|dog)-[0-9]{2,4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "lark": StructuredOutputsParams(grammar='start: "A" DIGIT+ "!"\nDIGIT: /[0-9]/'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "x" ("ab" | "cd"){1,3}'),
}
PROMPTS = ["The quick brown fox", "Hello world! How are you today?", "Once upon a time",
           "Why is the sky blue? Why is the sky blue? Why is the sky blue?"]


def greedy(constraint: StructuredOutputsParams, max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          structured_outputs=constraint)


def assert_obeys(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"(cat|dog)-[0-9]{2,4}", text), text
    elif kind == "choice":
        assert text in ("yes", "no", "maybe")
    elif kind == "lark":
        assert re.fullmatch(r"A[0-9]+!", text), text
    else:
        assert re.fullmatch(r"x(ab|cd){1,3}", text), text


@pytest.fixture(scope="module")
def llm(tool_artifact):
    return LLM(tool_artifact, speculative=False)


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_every_output_obeys_its_constraint(llm, kind):
    outputs = llm.generate(PROMPTS, greedy(CONSTRAINTS[kind]))
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert_obeys(kind, output.text)
    unconstrained = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=20, temperature=0.0))
    assert unconstrained[0].text != outputs[0].text  # the random model alone writes noise


def test_batching_changes_no_constrained_output(llm):
    """Constrained and plain requests in one batch give what each gives alone."""
    params = [greedy(CONSTRAINTS[kind]) for kind in CONSTRAINTS]
    params.append(SamplingParams(max_tokens=30, temperature=0.0))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == alone


def test_a_seeded_constrained_sample_is_the_same_in_any_batch(llm):
    sampled = SamplingParams(max_tokens=200, temperature=1.0, seed=3,
                             structured_outputs=CONSTRAINTS["regex"])
    alone = llm.generate([PROMPTS[0]], sampled)[0]
    batch = llm.generate(PROMPTS, [sampled, *[greedy(CONSTRAINTS["json"])] * 3])
    assert batch[0].token_ids == alone.token_ids
    assert alone.finish_reason == "stop"
    assert_obeys("regex", alone.text)


def test_speculation_changes_no_constrained_greedy_output(tool_artifact, llm):
    """n-gram drafts (γ tokens every step, at any batch size) are cut or rejected where
    the grammar forbids them: the outputs are plain decoding's, alone and batched."""
    params = [greedy(CONSTRAINTS[kind]) for kind in CONSTRAINTS for _ in range(2)]
    prompts = [PROMPTS[i % len(PROMPTS)] * 2 for i in range(len(params))]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    spec = LLM(tool_artifact, speculative_max_batch_size=16, adaptive_speculation=False)
    alone = [spec.generate([p], sp)[0] for p, sp in zip(prompts[:3], params[:3], strict=True)]
    batched = spec.generate(prompts, params)
    assert [o.token_ids for o in alone] == plain[:3]
    assert [o.token_ids for o in batched] == plain
    assert sum(o.metrics.speculation.num_accepted_tokens for o in batched) > 0


def test_a_schema_the_engine_cannot_compile_fails_before_queueing(llm):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}})
    with pytest.raises(GrammarError, match="Invalid type: strin"):
        llm.generate(PROMPTS[:1], greedy(bad))
    with pytest.raises(GrammarError, match="regex"):
        llm.generate(PROMPTS[:1], greedy(StructuredOutputsParams(regex="[a-")))
    assert not llm.engine.has_unfinished_requests()


def test_draft_rows_are_masked_at_the_state_after_their_path(llm):
    """A draft tree: row node + 1 gets the mask after the tokens on node's path; rows
    behind a draft the grammar rejects stay unmasked (they are never read)."""
    engine = llm.engine
    tokens = llm.tokenizer.encode('{"name": "ab", "size"', add_bos=False)
    request = Request("x", [1], greedy(CONSTRAINTS["json"]))
    request.grammar = engine.structured.matcher(CONSTRAINTS["json"])
    bad = llm.tokenizer.encode("}}", add_bos=False)[0]
    side = llm.tokenizer.encode(" ", add_bos=False)[0]  # whitespace after "{"
    assert side != tokens[1]
    # a chain of the first three tokens, a side branch after the first, a rejected leaf
    drafts = (*tokens[:3], side, bad)
    item = ScheduledRequest(request, 1 + len(drafts), len(drafts), drafts, (-1, 0, 1, 0, 2))
    vocab = engine.structured.vocab_size
    logits = np.zeros((6, vocab), dtype=np.float32)
    masked = mask_draft_rows(engine.structured, item, logits)
    paths = {0: [], 1: tokens[:1], 2: tokens[:2], 3: tokens[:3], 4: [tokens[0], side]}
    for row, path in paths.items():
        fresh = engine.structured.matcher(CONSTRAINTS["json"])
        assert fresh.consume_tokens(path)
        expected = allow_all(1, vocab)
        fill_mask(fresh, expected, 0)
        allowed = np.unpackbits(expected.view(np.uint8), count=vocab, bitorder="little")
        np.testing.assert_array_equal(np.isfinite(masked[row]), allowed.astype(bool))
    assert np.isfinite(masked[5]).all()  # behind the rejected draft: unread, unmasked
    assert request.grammar.validate_tokens(tokens) == len(tokens)  # rolled back


def test_an_answer_closes_within_its_token_budget(llm):
    """However short max_tokens (down to a few tokens more than the schema's shortest
    object needs), the answer finishes as valid JSON: the budget's last tokens close it."""
    closer = llm.engine.structured.closer
    shortest = len(closer.closing_path(llm.engine.structured.matcher(CONSTRAINTS["json"]),
                                       1000))
    budgets = [shortest + 3, shortest + 10, shortest + 40, 120]
    outputs = llm.generate(PROMPTS[:1] * len(budgets),
                           [greedy(CONSTRAINTS["json"], budget) for budget in budgets])
    for budget, output in zip(budgets, outputs, strict=True):
        assert output.finish_reason == "stop" and len(output.token_ids) <= budget
        assert_obeys("json", output.text)
    unbounded = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    output = llm.generate(PROMPTS[:1], greedy(unbounded, 60))[0]
    assert output.finish_reason == "stop" and isinstance(json.loads(output.text), list)
