"""StructuredOutputsParams: exactly one constraint, checked at construction."""

from __future__ import annotations

import pytest

from llmopt.runtime import SamplingParams
from llmopt.runtime.structured import StructuredOutputsParams


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got \['json', 'regex'\]"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")


def test_schema_text_is_parsed_and_bad_values_are_named():
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{type: integer}")
    with pytest.raises(ValueError, match="must be an object"):
        StructuredOutputsParams(json="[1, 2]")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="  ")


def test_key_identifies_the_constraint():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key() == StructuredOutputsParams(json={"a": 2, "b": 1}).key()
    assert a.key() != StructuredOutputsParams(json={"a": 2, "b": 1},
                                              disable_any_whitespace=True).key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampling_params_refuse_ignore_eos_with_a_constraint():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
