"""Structured outputs: generation constrained to a JSON schema, a regex, a choice of strings
or a grammar, through llguidance (`pip install "llmopt[structured]"`)."""

from llmopt.runtime.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
