"""The one registry of passes: recipe keys are exactly these names.

Each entry names the module that holds the pass. A pass module defines a frozen
pydantic `Config` (a model, or a tagged union of models) and
`run(ir, config, context) -> PassResult`; it is imported only when a recipe uses it, so
heavy dependencies load lazily. An import error is an error, never a silent skip.

What passes need of each other is data here, checked on the recipe's list of names
before any work starts (`check_order`): the facts a pass requires from earlier passes and
provides to later ones, facts at most one pass may provide, passes that must come before
the providers of some facts, and the compiler phase that runs each entry (the draft's
runs after every pass, so the recipe lists it last).

This module imports no other part of the compiler: the recipe validates its passes here,
and the pass manager (`pass_manager`) runs them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, TypeAdapter

# The compiler phase that runs a recipe entry: the passes rewrite the IR in recipe order;
# draft pairing (compiler/draft_pairing.py) then measures a draft against their result.
Phase = Literal["passes", "draft_pairing"]


@dataclass(frozen=True)
class PassEntry:
    module: str  # e.g. "llmopt.passes.rtn"
    requires: tuple[str, ...] = ()  # facts earlier passes must provide
    provides: tuple[str, ...] = ()
    before: tuple[str, ...] = ()  # facts whose providers must come after this pass
    path_keys: tuple[str, ...] = ()  # config keys holding file paths (resolved by the recipe)
    calibrates: bool = False  # may read calibration.text (so quality is measured past it)
    phase: Phase = "passes"  # the compiler phase that runs it


PASSES: dict[str, PassEntry] = {
    # Weight quantization: one per recipe.
    "rtn": PassEntry("llmopt.passes.rtn", provides=("quantized_weights",)),
    "gguf_weights": PassEntry("llmopt.passes.gguf_weights", provides=("quantized_weights",)),
    "awq": PassEntry("llmopt.passes.awq", provides=("quantized_weights",), calibrates=True),
    "gptq": PassEntry("llmopt.passes.gptq", provides=("quantized_weights",), calibrates=True),
    # Structural rewrites: they change shapes that quantization and the draft then see.
    "gqa_regroup": PassEntry("llmopt.passes.gqa_regroup",
                             before=("quantized_weights", "kv_cache", "draft"), calibrates=True),
    # An exact change of basis that int4 weights lose less in (before the weight pass).
    "rotate": PassEntry("llmopt.passes.rotate", before=("quantized_weights", "kv_cache", "draft")),
    # KV cache storage dtype (float16, bfloat16, fp8, int8, int4), per layer.
    "kv_cache": PassEntry("llmopt.passes.kv_cache", provides=("kv_cache",), calibrates=True),
    # Speculative decoding: pair a draft with the final target (it measures against it),
    # in the draft pairing phase after the passes; its module holds its Config.
    "draft": PassEntry("llmopt.passes.draft", provides=("draft",), phase="draft_pairing",
                       path_keys=("model", "corpus"), calibrates=True),
}

# Facts that at most one pass of a recipe may provide, and what they mean to a user.
UNIQUE_FACTS = {"quantized_weights": "weight-quantization", "kv_cache": "KV-cache",
                "draft": "draft"}


class PassStep(NamedTuple):
    """One validated entry of a recipe's `passes`."""

    name: str
    config: BaseModel


def load_pass(name: str) -> ModuleType:
    return importlib.import_module(PASSES[name].module)


def known_passes() -> str:
    return ", ".join(sorted(PASSES))


def validate_pass(name: str, options: Any) -> PassStep:
    """The typed step for `- name: {options}` (pydantic's ValidationError on bad options)."""
    if name not in PASSES:
        raise ValueError(f"unknown pass {name!r} (known: {known_passes()})")
    return PassStep(name, _config_adapter(name).validate_python(options or {}))


@functools.cache
def _config_adapter(name: str) -> TypeAdapter[Any]:
    """A pass's `Config`: a model, or a union of models told apart by a tag (draft kinds)."""
    return TypeAdapter(load_pass(name).Config)


def in_phase(steps: Sequence[PassStep], phase: Phase) -> list[PassStep]:
    """The recipe entries that `phase` runs, in recipe order."""
    return [step for step in steps if PASSES[step.name].phase == phase]


def check_order(names: Sequence[str]) -> None:
    """Every pass's requirements come from a pass before it, a unique fact is provided
    once, a `before` pass precedes the providers of its facts, and an entry that a phase
    after the passes runs (the draft) is the last: a one-line error naming both passes
    otherwise."""
    provider: dict[str, str] = {}  # fact -> the pass that provided it
    for index, name in enumerate(names):
        entry = PASSES[name]
        phased = next((n for n in names[:index] if PASSES[n].phase != "passes"), None)
        if phased is not None:
            raise ValueError(f"pass {name!r} comes after {phased!r}, which must be the "
                             "last pass")
        missing = [fact for fact in entry.requires if fact not in provider]
        if missing:
            raise ValueError(f"pass {name!r} needs {', '.join(missing)} from an earlier pass")
        for fact in entry.provides:
            if fact in UNIQUE_FACTS and fact in provider:
                raise ValueError(f"passes {provider[fact]!r} and {name!r} are both "
                                 f"{UNIQUE_FACTS[fact]} passes; a recipe takes one")
            provider[fact] = name
        late = next((provider[f] for f in entry.before if f in provider), None)
        if late is not None:
            raise ValueError(f"pass {name!r} must come before {late!r}")
