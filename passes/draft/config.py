"""The draft pass's config: one type per draft kind, told apart by `kind`.

  ngram: prompt lookup (`ngram: {min_n, max_n}`), no model.
  self:  `layers: k` the target's first k layers + final norm + LM head.
  tiny:  `hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size` a narrow,
         shallow model of the target's family, sliced from it and distilled.
  model: `model: PATH` another checkpoint; identical vocabularies pass, a subset is mapped
         onto target ids, anything else is refused naming the first mismatch.
Every kind with a model also takes its own `passes`, `head_vocab`, the distillation
options and `ngram: true|{...}` (n-gram lookup first, the model when it finds nothing).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    field_serializer,
    field_validator,
    model_validator,
)

from llmopt.compiler.pass_registry import PASSES, PassStep, check_order, validate_pass

MAX_GAMMA = 8


class NgramOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(1, ge=1)
    max_n: int = Field(4, ge=1, le=32)
    # latest: prompt lookup (the latest earlier occurrence); suffix: follower counts over
    # the sequence and the draft's `corpus` decide each token and the draft's length.
    method: Literal["latest", "suffix"] = "latest"
    min_confidence: float = Field(0.3, ge=0.0, le=1.0)  # suffix: frequency product floor
    length_per_match: float = Field(1.0, gt=0.0)  # suffix: drafts per matched token

    @model_validator(mode="after")
    def _ordered(self) -> NgramOptions:
        if self.min_n > self.max_n:
            raise ValueError("ngram needs min_n <= max_n")
        return self


class _Draft(BaseModel):
    """What every kind takes: γ, n-gram lookup and how the pairing is measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gamma: Literal["auto"] | int = "auto"  # draft tokens per step; auto: best measured
    ngram: NgramOptions | bool = False  # model drafts: prompt lookup first when it matches
    # Measurement: greedy continuations of `prompts` prompts (chat-style and, with
    # calibration text, text), step costs at `batch_sizes` with `context_len` cached tokens.
    prompts: int = Field(8, gt=0)
    new_tokens: int = Field(128, gt=0)
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16])
    context_len: int = Field(128, gt=0)
    cost_repeats: int = Field(5, gt=0)  # interleaved rounds; each step keeps its fastest
    min_speedup: float = Field(1.05, gt=0)  # below this predicted speedup: speculation off
    # n-gram `method: suffix` also counts followers in a corpus kept in the artifact: a
    # UTF-8 text file, or `self`: the target's own greedy answers to `corpus_prompts`
    # prompts (`data.self_prompts`) of `corpus_new_tokens` tokens each.
    corpus: str | None = None
    corpus_prompts: int = Field(64, gt=0)
    corpus_new_tokens: int = Field(128, gt=0)
    corpus_max_tokens: int = Field(200_000, gt=0)  # a text corpus's first tokens

    @model_validator(mode="before")
    @classmethod
    def _keys_fit_kind(cls, data: Any) -> Any:
        """A key of another kind gets a message naming the kind, not "extra input"."""
        if isinstance(data, dict):
            others = set().union(*(kind.model_fields for kind in KINDS)) - set(cls.model_fields)
            wrong = sorted(set(data) & others)
            if wrong:
                raise ValueError(f"{', '.join(wrong)} does not apply to kind "
                                 f"{data.get('kind')!r}")
        return data

    @field_validator("gamma")
    @classmethod
    def _gamma_range(cls, gamma: str | int) -> str | int:
        if isinstance(gamma, int) and not 1 <= gamma <= MAX_GAMMA:
            raise ValueError(f"gamma is auto or 1..{MAX_GAMMA}")
        return gamma

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, sizes: list[int]) -> list[int]:
        if not sizes or sorted(set(sizes)) != sizes or sizes[0] < 1:
            raise ValueError("batch_sizes is a non-empty increasing list of positive sizes")
        return sizes

    @model_validator(mode="after")
    def _corpus_needs_suffix(self) -> _Draft:
        ngram = self.ngram_options()
        if self.corpus is not None and (ngram is None or ngram.method != "suffix"):
            raise ValueError("corpus needs n-gram drafting with ngram.method: suffix")
        return self

    def ngram_options(self) -> NgramOptions | None:
        if isinstance(self.ngram, NgramOptions):
            return self.ngram
        return NgramOptions() if self.ngram else None


class NgramDraft(_Draft):
    kind: Literal["ngram"]
    ngram: NgramOptions | bool = True

    @model_validator(mode="after")
    def _lookup_on(self) -> NgramDraft:
        if self.ngram is False:
            raise ValueError("kind 'ngram' cannot switch n-gram lookup off")
        return self


class _ModelDraft(_Draft):
    """What every kind with a draft model takes: its own passes, head trimming and
    distillation towards the target."""

    trainable: ClassVar[tuple[str, ...]] = ("layers.*", "final_norm")  # glob patterns
    default_distill_steps: ClassVar[int] = 0
    default_distill_lr: ClassVar[float] = 5e-4

    passes: list[PassStep] = Field(default_factory=list)  # the draft's own passes
    head_vocab: int | None = Field(None, gt=0)  # keep the N most frequent tokens' rows
    distill_steps: int | None = Field(None, ge=0)  # None: the kind's default
    distill_lr: float | None = Field(None, gt=0)  # None: the kind's default
    distill_batch_size: int = Field(4, gt=0)
    distill_seq_len: int = Field(128, gt=1)  # text windows
    # self: distil on the target's greedy continuations of prompts, loss on those only
    distill_data: Literal["text", "self"] = "text"
    distill_prompts: int = Field(64, gt=1)
    distill_new_tokens: int = Field(96, gt=0)
    # With `ngram`: where the measurement predicts the n-gram drafts alone faster at the
    # first batch size than with the model as their fallback, the artifact keeps no model
    # (it costs more than it returns here); true keeps it anyway (another machine may
    # price it otherwise: the runtime's `drafts` option still chooses).
    keep_unpaid_model: bool = False

    @field_validator("passes", mode="before")
    @classmethod
    def _typed_passes(cls, entries: Any) -> list[PassStep]:
        """The draft's passes, validated through the registry (no draft of a draft)."""
        steps = []
        for entry in entries:
            if isinstance(entry, PassStep):
                steps.append(entry)
                continue
            if not isinstance(entry, dict) or len(entry) != 1:
                raise ValueError("each draft pass is a one-key mapping: `- name: {options}`")
            ((name, options),) = entry.items()
            if name not in PASSES or PASSES[name].phase != "passes":
                raise ValueError(f"unknown draft pass {name!r}")
            steps.append(validate_pass(name, options))
        check_order([step.name for step in steps])
        return steps

    @field_serializer("passes")
    def _dump_passes(self, steps: list[PassStep]) -> list[dict[str, Any]]:
        return [{step.name: step.config.model_dump(mode="json")} for step in steps]

    def steps(self) -> int:
        return self.distill_steps if self.distill_steps is not None else (
            self.default_distill_steps)

    def lr(self) -> float:
        return self.distill_lr or self.default_distill_lr


class SelfDraft(_ModelDraft):
    kind: Literal["self"]
    layers: int | None = Field(None, gt=0)  # None: a quarter of the target's


class TinyDraft(_ModelDraft):
    trainable: ClassVar[tuple[str, ...]] = ("*",)
    default_distill_steps: ClassVar[int] = 200
    default_distill_lr: ClassVar[float] = 1e-3

    kind: Literal["tiny"]
    hidden_size: int | None = Field(None, gt=0)  # None: derived from the target's
    num_layers: int = Field(2, gt=0)
    num_heads: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, gt=0)
    intermediate_size: int | None = Field(None, gt=0)


class ModelDraft(_ModelDraft):
    kind: Literal["model"]
    model: str | None = None

    @model_validator(mode="after")
    def _has_model(self) -> ModelDraft:
        if not self.model:
            raise ValueError("kind 'model' needs `model: PATH`")
        return self


KINDS = (NgramDraft, SelfDraft, TinyDraft, ModelDraft)
Config = Annotated[NgramDraft | SelfDraft | TinyDraft | ModelDraft,
                   Field(discriminator="kind")]
DraftModelConfig = SelfDraft | TinyDraft | ModelDraft
_ADAPTER: TypeAdapter[Config] = TypeAdapter(Config)


def make_config(**options: Any) -> NgramDraft | DraftModelConfig:
    """The config of one draft kind from `kind=...` and its options."""
    return _ADAPTER.validate_python(options)
