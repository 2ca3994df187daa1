"""llmopt.runtime: load a compiled artifact and generate with it (numpy + onnxruntime only).

`LLM` is imported lazily so that `llmopt.runtime.contract` and `.manifest`, which the
compiler shares, load without onnxruntime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmopt.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmopt.runtime.llm import LLM
    from llmopt.runtime.output import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from llmopt.runtime.llm import LLM

        return LLM
    if name == "RequestOutput":
        from llmopt.runtime.output import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'llmopt.runtime' has no attribute {name!r}")
