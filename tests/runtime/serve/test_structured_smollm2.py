"""Structured outputs on the real model, SmolLM2-135M-Instruct (its GGUF's Q4_1 weights, an
n-gram draft): `chat.completions.parse` with a pydantic model through the official client,
a schema with nested objects, enums and arrays, streamed and whole, and constrained greedy
outputs unchanged by batching and by speculation. Slow: runs in CI."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import jsonschema
import pytest
import yaml
from live_server import MODEL, live_server
from pydantic import BaseModel, Field

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.structured import StructuredOutputsParams

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "smollm2-135m-q4_1.yaml"
NGRAM = {"kind": "ngram", "gamma": 4, "prompts": 2, "new_tokens": 16, "batch_sizes": [1],
         "cost_repeats": 1}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "genre": {"enum": ["fantasy", "science fiction", "mystery"]},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "author": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "alive": {"type": "boolean"}},
        "required": ["name", "alive"], "additionalProperties": False},
    "characters": {"type": "array", "items": {"type": "string", "maxLength": 20},
                   "minItems": 1, "maxItems": 3},
}, "required": ["title", "genre", "year", "author", "characters"],
    "additionalProperties": False}
PROMPTS = ["Describe a famous novel as JSON.", "Invent a book and describe it.",
           "Tell me about a mystery novel.", "What is your favourite book?",
           "Describe a science fiction classic.", "Give me a fantasy book recommendation.",
           "Summarize a detective story as data.", "Name a book from 1950."]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    address: Address


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    raw = yaml.safe_load(RECIPE.read_text())
    raw["passes"] = [*raw["passes"], {"draft": NGRAM}]
    out = tmp_path_factory.mktemp("smollm2-structured") / "q4_1-ngram"
    compile_recipe(Recipe.model_validate(raw), out, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def server(artifact):
    with live_server(artifact, speculative=False) as (base, srv):
        yield base, srv


def nested(max_tokens: int = 300) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(json=NESTED))


def test_parse_with_a_pydantic_model_gives_a_valid_instance(client):
    reply = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a fictional person."}],
        response_format=Person, temperature=0, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert isinstance(choice.message.parsed.favorite_color, Color)


def test_nested_schema_streamed_and_whole(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": NESTED,
                                                  "strict": True}}
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=300, response_format=fmt)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), NESTED)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=300, response_format=fmt,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_batching_and_speculation_change_no_constrained_greedy_output(artifact):
    plain = LLM(artifact, speculative=False)
    prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    alone = [plain.generate([p], nested())[0] for p in prompts]
    for output in alone:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), NESTED)
    expected = [o.token_ids for o in alone]
    assert [o.token_ids for o in plain.generate(prompts, nested())] == expected
    spec = LLM(artifact, speculative_max_batch_size=16, adaptive_speculation=False)
    batched = spec.generate(prompts, nested())
    assert [o.token_ids for o in batched] == expected
    assert sum(o.metrics.speculation.num_accepted_tokens for o in batched) > 0
    assert [spec.generate([p], nested())[0].token_ids for p in prompts[:2]] == expected[:2]
