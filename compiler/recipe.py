"""The recipe: YAML validated once, at the boundary, with errors that name key and line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from llmopt.compiler.pass_registry import PASSES, PassStep, known_passes, validate_pass
from llmopt.runtime.manifest import RuntimeDefaults


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key and, if known, the line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationConfig(_Strict):
    text: str | None = None  # a UTF-8 text file, mixed with the model's own samples
    samples: int = Field(128, gt=0)
    seq_len: int = Field(512, gt=0)
    # Share of the windows sampled from the model itself (compiler/calibration_mix.py);
    # auto: all of them without a text, a measured share with one. 0: the text alone.
    model_samples: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = "auto"
    # The calibration forward's linears and AWQ's search products (summed in float32). auto:
    # bfloat16 where the checkpoint stores its decoder linears in bfloat16 (the model's own
    # precision, as GPU calibration runs it) and the CPU has bfloat16 dot products (about
    # twice as fast there), float32 otherwise.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"

    @model_validator(mode="after")
    def _text_for_the_rest(self) -> CalibrationConfig:
        if self.model_samples != "auto" and self.model_samples < 1 and self.text is None:
            raise ValueError(f"model_samples {self.model_samples} leaves windows to "
                             "calibration.text, which is not set")
        return self


class TargetConfig(_Strict):
    backend: Literal["onnxruntime"] = "onnxruntime"
    device: Literal["cpu"] = "cpu"
    weight_dtype: Literal["float32", "float16"] = "float32"
    # Contrib (fused) operators for ONNX Runtime, or standard ONNX only.
    operator_set: Literal["onnxruntime", "standard"] = "onnxruntime"
    # MatMulNBits' accuracy_level for quantized linears: 0 computes in float32 (exactly the
    # fake-quantized model); 4 quantizes activations to int8 per block (faster, not exact;
    # what the native step runs). Unset: 4 where a weight pass quantizes the LM head by its
    # default (the fast path), else 0; `Recipe` resolves it, so it is never None after.
    nbits_accuracy_level: Literal[0, 4] | None = None
    # How integer weights reach ONNX Runtime: its MatMulNBits kernel directly, or standard
    # blocked DequantizeLinear → MatMul (which ONNX Runtime fuses back into MatMulNBits);
    # auto: the operator set's form (benchmarks/bench_int4.py measures both).
    quantized_matmul: Literal["auto", "matmul_nbits", "dequantize_linear"] = "auto"
    # KV pool layout (llmopt.runtime.contract): "lanes" lets ONNX Runtime's fused
    # GroupQueryAttention read and append each sequence's KV in place; "blocks" gathers
    # a step's blocks (any KV dtype, any operator set); auto: lanes wherever it can run.
    kv_layout: Literal["auto", "blocks", "lanes"] = "auto"


class QualityConfig(_Strict):
    # Every lossy pass is measured against its input (perplexity, KL, top-1 agreement),
    # printed and stored in the manifest; `measure: false` turns it off.
    measure: bool = True
    # Budget for each lossy pass, in % perplexity. Default None: no budget — the cost is
    # measured, printed and stored, never fails the compile (what int4 weights cost depends
    # on the model, so a budget is a measured choice, not a constant). A budget needs
    # real text (eval_text or calibration.text): the perplexity of the model's own samples
    # is not a text perplexity.
    max_ppl_increase_pct: float | None = Field(None, ge=0)
    # What the passes measure on: `sampled_sequences` sequences of `sampled_tokens` tokens
    # sampled from the input model itself (temperature 1, `seed`: always available, any
    # language, no calibration domain), and held-out text, the first of: `eval_text`, the
    # last `eval_windows` windows of calibration.text (calibration takes the first).
    eval_text: str | None = None
    eval_windows: int = Field(8, gt=0)
    eval_seq_len: int = Field(512, gt=0)
    sampled_sequences: int = Field(16, gt=0)
    sampled_tokens: int = Field(256, ge=2)
    seed: int = 0


class Recipe(_Strict):
    model: str
    # `- name: {options}` entries, each validated into a PassStep (name, typed Config).
    passes: list[PassStep] = Field(default_factory=list)
    calibration: CalibrationConfig = CalibrationConfig()
    target: TargetConfig = TargetConfig()
    quality: QualityConfig = QualityConfig()
    runtime: RuntimeDefaults = RuntimeDefaults()  # the manifest keeps it as it is

    @field_validator("passes", mode="before")
    @classmethod
    def _typed_passes(cls, entries: Any) -> list[PassStep]:
        """Raw `{name: options}` mappings become typed steps; `load_recipe` hands over
        steps it already validated (with YAML lines in its errors), kept as they are."""
        if not isinstance(entries, list):
            raise ValueError("passes is a list of `- name: {options}` entries")
        return [entry if isinstance(entry, PassStep) else _pass_step(entry)
                for entry in entries]

    @field_serializer("passes")
    def _dump_passes(self, steps: list[PassStep]) -> list[dict[str, Any]]:
        return [{step.name: step.config.model_dump(mode="json")} for step in steps]

    @model_validator(mode="after")
    def _resolve_accuracy_level(self) -> Recipe:
        if self.target.nbits_accuracy_level is None:
            fast = any(getattr(step.config, "include_lm_head", False) is None
                       for step in self.passes)
            # a copy: the default TargetConfig instance is shared between recipes
            target = self.target.model_copy(update={"nbits_accuracy_level": 4 if fast else 0})
            object.__setattr__(self, "target", target)  # frozen: set once, while validating
        return self

    @model_validator(mode="after")
    def _budget_has_text(self) -> Recipe:
        quality = self.quality
        if quality.max_ppl_increase_pct is not None and (
                not quality.measure or self.quality_text() is None):
            raise ValueError("quality.max_ppl_increase_pct needs quality.eval_text or "
                             "calibration.text to measure on (and quality.measure on): "
                             "perplexity of the model's own samples is not a text perplexity")
        return self

    def quality_kind(self) -> str:
        """What text lossy passes are measured on besides the model's samples: "off",
        "eval_text", "calibration_tail" (none if no window is left past calibration) or
        "samples" (none) — the one decision `QualityProbes.for_recipe` builds from."""
        if not self.quality.measure:
            return "off"
        if self.quality.eval_text is not None:
            return "eval_text"
        return "calibration_tail" if self.calibration.text is not None else "samples"

    def quality_source(self, model_sampled: bool = True) -> str:
        """What lossy passes will be measured on, in words (`model_sampled` False: the
        model is too large to sample, compiler/sample_budget.py)."""
        quality, kind = self.quality, self.quality_kind()
        samples = (f"{quality.sampled_sequences} x {quality.sampled_tokens} tokens sampled "
                   "from the model" if model_sampled else
                   "the built-in English passages (the model is too large to sample)")
        text = {
            "off": "not measured (quality.measure: false)",
            "eval_text": f"quality.eval_text {quality.eval_text}",
            "calibration_tail": f"the held-out tail of calibration.text {self.calibration.text} "
                                "(if a window is left past calibration)",
            "samples": samples,
        }[kind]
        return f"{text}, and {samples}" if kind in ("eval_text", "calibration_tail") else text

    def quality_text(self) -> str | None:
        """The text passes measure their cost on: eval_text, else calibration.text (None:
        the input model's own samples)."""
        return self.quality.eval_text or self.calibration.text


def _pass_step(entry: Any) -> PassStep:
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ValueError("each pass is a one-key mapping: `- name: {options}`")
    ((name, options),) = entry.items()
    return validate_pass(name, options)


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override (`key.path=value`) and validate a recipe file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc.strerror}") from exc
    try:
        raw = yaml.safe_load(text) or {}
        lines = _key_lines(yaml.compose(text))
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_error(exc, path)) from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of keys, got {type(raw).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    raw = _resolve_paths(raw, path.parent)
    _check_files(raw, path, lines)
    raw["passes"] = _validated_passes(raw.get("passes", []), path, lines)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(_describe(exc, path, lines)) from None


def _validated_passes(entries: Any, path: Path, lines: dict[tuple, int]) -> Any:
    """Each `- name: {options}` as a typed PassStep, errors naming the pass's YAML line;
    anything not shaped like a pass list is left to the schema's message."""
    _check_pass_names(entries, path, lines)
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and len(e) == 1 for e in entries):
        return entries
    steps = []
    for index, entry in enumerate(entries):
        ((name, options),) = entry.items()
        try:
            steps.append(validate_pass(name, options))
        except ValidationError as exc:
            raise RecipeError(_describe(exc, path, lines, ("passes", index, name))) from None
    return steps


def _yaml_error(exc: yaml.YAMLError, path: Path) -> str:
    """`file:line:column: invalid YAML: what, and where the construct it broke began`."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    began = f" ({context} from line {start.line + 1})" if context and start else ""
    return f"{where}: invalid YAML: {problem}{began}"


def _check_pass_names(entries: Any, path: Path, lines: dict[tuple, int]) -> None:
    """Name the line of an unknown pass (the schema alone would point at `passes:`)."""
    if not isinstance(entries, list):
        return
    for index, entry in enumerate(entries):
        if isinstance(entry, dict) and len(entry) == 1:
            (name,) = entry
            if name not in PASSES:
                line = lines.get(("passes", index))
                where = f"{path}:{line}" if line else str(path)
                raise RecipeError(f"{where}: passes.{index}: unknown pass {name!r} "
                                  f"(known: {known_passes()})")


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set expects key.path=value, got {override!r}")
    node: Any = raw
    parts = key.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {key}: {where} is not an index of a "
                                  f"{len(node)}-item list")
            part = int(part)
        elif not isinstance(node, dict):
            raise RecipeError(f"--set {key}: {'.'.join(parts[:depth])} is a "
                              f"{type(node).__name__}, not a section with keys")
        if depth == len(parts) - 1:
            node[part] = yaml.safe_load(value)
        else:
            node = node[part] if isinstance(node, list) else node.setdefault(part, {})


FILE_KEYS = (("calibration", "text"), ("quality", "eval_text"))  # text files a recipe names


def _resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative file paths in a recipe are relative to the recipe's directory (else to the
    current one, as `--set` values typed at a prompt are)."""
    def resolve(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            candidate = base / value
            return str(candidate) if candidate.exists() else value
        return value

    raw = dict(raw)
    if "model" in raw:
        raw["model"] = resolve(raw["model"])
    for section, key in FILE_KEYS:
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raw[section] = {**raw[section], key: resolve(raw[section][key])}
    if isinstance(raw.get("passes"), list):  # the path keys the registry names, too
        raw["passes"] = [_resolve_pass_paths(entry, resolve) for entry in raw["passes"]]
    return raw


def _check_files(raw: dict[str, Any], path: Path, lines: dict[tuple, int]) -> None:
    """Every text file the recipe names exists: found now, not after minutes of work."""
    for section, key in FILE_KEYS:
        value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str) and not Path(value).expanduser().is_file():
            line = lines.get((section, key))
            where = f"{path}:{line}" if line else str(path)
            raise RecipeError(f"{where}: {section}.{key}: file not found: {value} (relative "
                              f"paths are looked up beside the recipe, in {path.parent})")


def _resolve_pass_paths(entry: Any, resolve: Any) -> Any:
    if not (isinstance(entry, dict) and len(entry) == 1):
        return entry
    ((name, options),) = entry.items()
    keys = PASSES[name].path_keys if name in PASSES else ()
    if not isinstance(options, dict) or not any(k in options for k in keys):
        return entry
    return {name: {k: resolve(v) if k in keys else v for k, v in options.items()}}


def _key_lines(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    """Map each key path (as pydantic reports it) to its 1-based YAML line."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = (*prefix, key_node.value)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = (*prefix, index)
            lines[path] = item.start_mark.line + 1
            lines.update(_key_lines(item, path))
    return lines


def _describe(
    exc: ValidationError, path: Path, lines: dict[tuple, int], prefix: tuple = ()
) -> str:
    messages = []
    for error in exc.errors():
        loc = (*prefix, *error["loc"])
        line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
        where = f"{path}:{line}" if line else str(path)
        key = ".".join(map(str, loc)) or "(top level)"
        reason = ("unknown key" if error["type"] == "extra_forbidden"
                  else str(error["ctx"]["error"]) if error["type"] == "value_error"
                  else error["msg"])
        messages.append(f"{where}: {key}: {reason}")
    return "; ".join(messages)


def resolved_dict(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json")
