"""GrammarCompiler: a request's StructuredOutputsParams -> an llguidance grammar, checked
against the artifact's tokenizer, and the per-request matcher that walks it.

llguidance is imported here only (an optional dependency: `llmopt[structured]`); it needs
neither torch nor transformers, and builds its token tables from tokenizer.json itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmopt.runtime.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from llmopt.runtime.tokenizer import Tokenizer

# JSON whitespace between tokens: a line break and some indentation at most (llama.cpp's
# rule); unbounded whitespace lets a small model pad forever instead of closing the value.
JSON_WHITESPACE = r"[\x20\x09]{0,16}(\x0A[\x20\x09]{0,24})?"
CACHE_SIZE = 256  # compiled constraints kept
INSTALL_HINT = 'structured outputs need llguidance: pip install "llmopt[structured]"'


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the problem."""


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise GrammarError(INSTALL_HINT) from exc
    return llguidance


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars are cached by constraint."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]):
        llg = import_llguidance()
        self.llguidance = llg
        eos = list(eos_token_ids) or [tokenizer.eos_token_id]
        try:
            self.tokenizer = llg.LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=eos)
        except ValueError as exc:
            raise GrammarError(f"the grammar engine cannot read this tokenizer: {exc}") from exc
        self.vocab_size = self.tokenizer.vocab_size
        self._cache: OrderedDict[str, str] = OrderedDict()  # constraint key -> grammar

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise GrammarError when `params` does not compile (cached when it does)."""
        self.grammar(params)

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the constraint's start, for one request."""
        matcher = self.llguidance.LLMatcher(self.tokenizer, self.grammar(params))
        if matcher.is_error():
            raise GrammarError(f"{params.kind}: {_first_line(matcher.get_error())}")
        return matcher

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The checked grammar text of a constraint, from the cache when it was seen."""
        key = params.key()
        grammar = self._cache.get(key)
        if grammar is None:
            grammar = self._cache[key] = self._compile(params)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> str:
        try:
            grammar = to_grammar(self.llguidance, params)
        except ValueError as exc:
            raise GrammarError(f"{params.kind}: {exc}") from exc
        failed, messages = self.llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        if failed:
            raise GrammarError(f"{params.kind}: {_first_line(messages[0])}")
        return grammar


def to_grammar(llg: Any, params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a constraint (not yet checked)."""
    whitespace = ({"whitespace_flexible": False} if params.disable_any_whitespace
                  else {"whitespace_pattern": JSON_WHITESPACE})
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
    if params.regex is not None:
        return llg.grammar_from("regex", params.regex)
    if params.choice is not None:
        return llg.grammar_from("choice", params.choice)
    grammar = params.grammar or ""
    return llg.grammar_from("grammar", grammar)  # Lark (a `start:` rule) or GBNF


def _first_line(message: str) -> str:
    """llguidance's errors can carry a source excerpt below the first line; keep it short."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines[:3]) if len(lines) <= 3 else lines[0]
    return text[:500]
