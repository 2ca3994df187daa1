"""The recipe: YAML validated once at load, errors naming key and line, passes typed."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.compiler.pass_registry import PassStep
from llmopt.compiler.recipe import Recipe, RecipeError, load_recipe, resolved_dict
from llmopt.passes import rtn
from llmopt.runtime.manifest import RuntimeDefaults


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_passes_are_typed_steps_validated_at_load(tmp_path):
    recipe = load_recipe(write(tmp_path, "model: m\npasses:\n  - rtn: {bits: 8}\n"))
    (step,) = recipe.passes
    assert isinstance(step, PassStep) and step.name == "rtn"
    assert isinstance(step.config, rtn.Config) and step.config.bits == 8
    assert resolved_dict(recipe)["passes"] == [{"rtn": step.config.model_dump(mode="json")}]


def test_a_programmatic_recipe_types_its_passes_too():
    recipe = Recipe(model="m", passes=[{"rtn": {"group_size": 32}}])
    assert recipe.passes[0].config.group_size == 32
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        Recipe(model="m", passes=[{"nope": {}}])


@pytest.mark.parametrize(("text", "message"), [
    ("model: m\ncalibration:\n  sample: 3\n", "recipe.yaml:3: calibration.sample: unknown key"),
    ("model: m\npasses:\n  - rtn: {}\n  - fancy: {}\n",
     "recipe.yaml:4: passes.1: unknown pass 'fancy' (known: "),
    ("model: m\npasses:\n  - rtn:\n      bits: 3\n", "recipe.yaml:4: passes.0.rtn.bits:"),
    ("model: m\nruntime:\n  block_size: 0\n", "recipe.yaml:3: runtime.block_size:"),
])
def test_errors_name_the_key_and_the_line(tmp_path, text, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        load_recipe(write(tmp_path, text))


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path):
    (tmp_path / "calib.txt").write_text("text")
    (tmp_path / "drafts" / "small").mkdir(parents=True)
    recipe = load_recipe(write(tmp_path, (
        "model: m\ncalibration: {text: calib.txt}\n"
        "passes:\n  - draft: {kind: model, model: drafts/small}\n")))
    assert recipe.calibration.text == str(tmp_path / "calib.txt")
    assert recipe.passes[0].config.model == str(tmp_path / "drafts" / "small")


def test_overrides_apply_before_validation(tmp_path):
    path = write(tmp_path, "model: m\npasses:\n  - rtn: {bits: 4}\n")
    assert load_recipe(path, ["passes.0.rtn.bits=8"]).passes[0].config.bits == 8
    with pytest.raises(RecipeError, match="passes.0.rtn.bits"):
        load_recipe(path, ["passes.0.rtn.bits=5"])


def test_the_runtime_section_is_the_manifests_type():
    assert isinstance(Recipe(model="m").runtime, RuntimeDefaults)


def test_a_missing_text_file_is_named_at_load(tmp_path):
    path = write(tmp_path, "model: m\ncalibration:\n  text: does-not-exist.txt\n")
    with pytest.raises(RecipeError, match=r"recipe.yaml:3: calibration.text: file not found: "
                                          r"does-not-exist.txt \(relative paths are looked up "
                                          r"beside the recipe"):
        load_recipe(path)


def test_invalid_yaml_keeps_its_position(tmp_path):
    with pytest.raises(RecipeError, match=r"recipe.yaml:3:1: invalid YAML: expected ',' or "
                                          r"'\]'.*\(while parsing a flow sequence from line 2"):
        load_recipe(write(tmp_path, "model: m\npasses: [unclosed\n"))


def test_a_budget_measures_on_the_calibration_texts_tail(tmp_path):
    (tmp_path / "calib.txt").write_text("words " * 10)
    recipe = load_recipe(write(tmp_path, (
        "model: m\ncalibration: {text: calib.txt}\nquality: {max_ppl_increase_pct: 5}\n")))
    assert recipe.quality_text() == str(tmp_path / "calib.txt")
    with pytest.raises(RecipeError, match="needs quality.eval_text or calibration.text"):
        load_recipe(write(tmp_path, "model: m\nquality: {max_ppl_increase_pct: 5}\n"))


def test_the_recipe_says_what_lossy_passes_will_be_measured_on(tmp_path):
    (tmp_path / "calib.txt").write_text("words")
    assert Recipe(model="m").quality_source() == "16 x 256 tokens sampled from the model"
    assert Recipe(model="m", quality={"measure": False}).quality_source() == (
        "not measured (quality.measure: false)")
    recipe = Recipe(model="m", calibration={"text": str(tmp_path / "calib.txt")})
    assert recipe.quality_source().startswith("the held-out tail of calibration.text ")
    assert recipe.quality_source().endswith(", and 16 x 256 tokens sampled from the model")
    recipe = Recipe(model="m", quality={"eval_text": "e.txt"})
    assert recipe.quality_source() == ("quality.eval_text e.txt, and 16 x 256 tokens sampled "
                                       "from the model")
