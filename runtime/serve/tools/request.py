"""The `tools`, `tool_choice` and `parallel_tool_calls` request fields, and the plan they
make for one chat request: what the template sees, what the grammar forces, what to parse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmopt.runtime.serve.tools import formats
from llmopt.runtime.serve.tools.formats import ToolFormat
from llmopt.runtime.structured.params import StructuredOutputsParams
from llmopt.runtime.tokenizer import Tokenizer

FORMATS_HELP = ("tool calls need a chat template with a tool-call format llmopt reads: "
                "Qwen2.5/Qwen3's <tool_call>, Llama 3.1+'s JSON or Mistral's [TOOL_CALLS]")


class ToolError(ValueError):
    """A bad tools request; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]]  # as the chat template gets them
    functions: list[dict[str, Any]]  # each tool's function definition
    format: ToolFormat | None  # None only with tool_choice "none"
    choice: str  # "none", "auto", "required" or the named function
    parallel: bool

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self, tokenizer: Tokenizer) -> StructuredOutputsParams | None:
        """The grammar that forces calls: for `required` and a named function."""
        if self.choice in ("none", "auto") or self.format is None:
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        parallel = self.parallel and self.choice == "required"
        return StructuredOutputsParams(grammar=formats.grammar(
            self.format, chosen, parallel, special_token_ids(tokenizer)))


def plan_tools(fields: ToolFields, template: str | None) -> ToolPlan | None:
    """The request's tool plan (None without tools); ToolError naming a bad field."""
    choice = fields.tool_choice
    if not fields.tools:
        if choice is not None and choice != "none":
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in fields.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError(f"tools: function names must be unique, got {names}", "tools")
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
        if choice not in names:
            raise ToolError(f"tool_choice names the function '{choice}', which is not among "
                            f"the tools {names}", "tool_choice")
    choice = choice or "auto"
    fmt = formats.detect_tool_format(template)
    if fmt is None and choice != "none":
        raise ToolError(f"{FORMATS_HELP}; this model's template has none (send "
                        "tool_choice 'none', or no tools)", "tools")
    return ToolPlan([t.model_dump(exclude_none=True) for t in fields.tools], functions, fmt,
                    choice, fields.parallel_tool_calls)


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Special tokens of the tokenizer by text (a grammar must name them by id)."""
    added = tokenizer.tokenizer.get_added_tokens_decoder()
    return {token.content: token_id for token_id, token in added.items() if token.special}
