"""`llmopt inspect` names the weight quantization and the draft's γ and α."""

from __future__ import annotations

from toy_artifact import add_draft, build_artifact

from llmopt.tools.inspect import describe, format_description


def lines_of(path) -> list[str]:
    return format_description(describe(path)).splitlines()


def test_weight_quantization_is_one_line(tiny_checkpoints, tmp_path):
    from llmopt.compiler.pipeline import compile_recipe
    from llmopt.compiler.recipe import Recipe

    recipe = Recipe.model_validate({"model": str(tiny_checkpoints["llama"]),
                                    "passes": [{"rtn": {"bits": 4, "group_size": 32,
                                                        "include_lm_head": False}}],
                                    "quality": {"measure": False},
                                    "runtime": {"max_context": 64}})
    compile_recipe(recipe, tmp_path / "a", log=lambda _: None)
    (line,) = [x for x in lines_of(tmp_path / "a") if x.startswith("weights")]
    assert line.startswith("weights       rtn: int4, groups of 32, asymmetric; 21 linears "
                           "(LM head float), ")
    assert line.endswith("float32; other weights float32")


def test_speculation_shows_drafts_gamma_and_alpha(tmp_path):
    directory = add_draft(build_artifact(tmp_path / "toy"), gamma=2, ngram=True)
    lines = lines_of(directory)
    assert "weights       float32 (no weight quantization)" in lines
    assert ("speculative   ngram (n 1-3) + draft model (model, vocab 64), γ 2, up to batch 16"
            in lines)
    assert not any(line.strip().startswith("α") for line in lines)  # none measured here


def test_measured_acceptance_is_listed_per_position(tmp_path):
    import json

    directory = add_draft(build_artifact(tmp_path / "toy"), gamma=2, ngram=True)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["speculative"] |= {"acceptance": [0.5, 0.25], "predicted_speedup": 1.5}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    lines = lines_of(directory)
    assert "  α           0.50 0.25 (acceptance at each draft position)" in lines
    assert any(line.endswith("up to batch 16, predicted 1.50x at batch 1") for line in lines)
