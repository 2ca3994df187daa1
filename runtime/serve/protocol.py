"""The OpenAI request bodies the server accepts, validated once at the boundary.

Fields clients send that change nothing here (`user`, `presence_penalty` at 0, ...) are
accepted and ignored, as vLLM does; a value out of range is a 400 naming the field.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.serve.constraints import ConstraintFields
from llmopt.runtime.serve.tools.request import ToolFields
from llmopt.runtime.structured.params import StructuredOutputsParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it; content parts joined into text."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ValueError("only text content parts are supported")
            message["content"] = "".join(parts)
        message["role"] = "system" if self.role == "developer" else self.role
        for call in message.get("tool_calls") or ():
            _arguments_as_object(call)
        return message


def _arguments_as_object(call: Any) -> None:
    """Templates write a call's arguments with `tojson`: give them the object that the
    JSON string OpenAI sends encodes (as vLLM does)."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template gets text
            function["arguments"] = json.loads(function["arguments"])


class SamplingRequest(ConstraintFields):
    """The sampling fields chat and completions share (and what constrains the output)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        return stop

    def sampling_params(self, defaults: SamplingParams, max_tokens: int, seed_offset: int,
                        logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Engine parameters: the request's values over the artifact's generation defaults."""
        chosen = {
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "top_k": max(self.top_k, 0) if self.top_k is not None else None,
        }
        values = {k: v for k, v in chosen.items() if v is not None}
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=values.get("temperature", defaults.temperature),
            top_k=values.get("top_k", defaults.top_k),
            top_p=values.get("top_p", defaults.top_p),
            min_p=values.get("min_p", defaults.min_p),
            repetition_penalty=values.get("repetition_penalty", defaults.repetition_penalty),
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured_outputs=structured,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's limit
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("one prompt per request is supported; send one request each")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
