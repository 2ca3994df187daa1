"""What a request constrains its output to: OpenAI's `response_format`, and vLLM's
`structured_outputs` object or its older top-level `guided_*` fields, as one
StructuredOutputsParams (at most one of them per request)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.runtime.structured.params import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class ConstraintFields(BaseModel):
    """The request fields that constrain the output."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint and the field it came from (None, None: unconstrained).
        Raises ValueError naming the problem."""
        given = _given(self)
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format, structured_outputs and "
                             f"guided_*; got {', '.join(name for name, _ in given)}")
        if not given:
            return None, None
        name, params = given[0]
        return params(), name


def _given(fields: ConstraintFields) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    fmt = fields.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", lambda: StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.json_schema
        found.append(("response_format", lambda: StructuredOutputsParams(json=schema)))
    so = fields.structured_outputs
    if so is not None:
        found.append(("structured_outputs", lambda: StructuredOutputsParams(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
            json_object=bool(so.json_object),
            disable_any_whitespace=so.disable_any_whitespace)))
    guided = {"json": fields.guided_json, "regex": fields.guided_regex,
              "choice": fields.guided_choice, "grammar": fields.guided_grammar}
    for kind, value in guided.items():
        if value is not None:
            found.append((f"guided_{kind}",
                          lambda kind=kind, value=value: StructuredOutputsParams(
                              **{kind: value})))
    return found
