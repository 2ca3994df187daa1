"""StructuredOutputsParams: the constraint one request's output must satisfy (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its text), `regex`, `choice`
    (the output is one of these strings), `grammar` (Lark, or llama.cpp's GBNF) or
    `json_object=True` (any JSON object). `disable_any_whitespace`: JSON without
    whitespace between tokens (by default a little is allowed, as a model writes it)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, "
                             f"grammar or json_object; got {given or 'none'}")
        if isinstance(self.json, str):
            object.__setattr__(self, "json", _parse_schema(self.json))
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A text that identifies the constraint (what compiled grammars are cached by)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace],
                          sort_keys=True)


def _parse_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
