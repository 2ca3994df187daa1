"""A seeded generator of random JSON schemas (and of instances that satisfy them).

The structured-output acceptance run (`structured_output.py`) asks the model for one answer
per schema; the schemas are fixed by the seed alone, so the run is the same test every time.
Schemas look like what applications send: an object root, nested objects, arrays, enums,
nullable fields, numeric bounds, some strings and arrays bounded, some not.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = ["name", "title", "city", "country", "age", "count", "price", "score", "tags",
         "items", "author", "year", "status", "kind", "color", "size", "email", "notes",
         "rating", "address", "owner", "id", "label", "level", "language", "summary"]
WORDS = ["red", "green", "blue", "small", "large", "open", "closed", "new", "old", "fast",
         "slow", "alpha", "beta", "gamma", "north", "south"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-5 properties (fewer deeper down), some required."""
    names = rng.sample(NAMES, rng.randint(1, 5 if depth == 0 else 3))
    properties = {name: _value_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "nullable"]
    if depth < 3:
        kinds += ["array", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.5:
            schema["maxLength"] = rng.choice([10, 20, 40, 80])
        return schema
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "nullable":
        return {"type": [rng.choice(["string", "integer"]), "null"]}
    if kind == "array":
        schema = {"type": "array", "items": _value_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            schema["minItems"] = rng.randint(0, 2)
            schema["maxItems"] = schema["minItems"] + rng.randint(1, 4)
        return schema
    return random_schema(rng, depth)


def schemas(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


def random_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value valid under one of `schemas`' schemas (for timing a grammar engine)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "object":
        return {name: random_instance(sub, rng) for name, sub in schema["properties"].items()}
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems", 3)
        return [random_instance(schema["items"], rng) for _ in range(rng.randint(low, high))]
    if kind == "string":
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        return text[: schema.get("maxLength", len(text))]
    if kind == "integer":
        return rng.randint(schema.get("minimum", -50), schema.get("maximum", 50))
    if kind == "number":
        return round(rng.uniform(-100, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    return None
