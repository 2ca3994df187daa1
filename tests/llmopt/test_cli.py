"""The CLI end to end on a tiny checkpoint, and every kind of bad input it must refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import GPT2Config, GPT2LMHeadModel

from llmopt.cli import main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, stderr: str, *needles: str) -> None:
    assert code != 0
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def write_recipe(directory: Path, text: str) -> Path:
    path = directory / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("cli")
    recipe = write_recipe(directory, f"model: {tiny_checkpoints['llama']}\n"
                                     "runtime: {block_size: 4, max_context: 64}\n")
    code, out, err = run("compile", recipe, "-o", directory / "art")
    assert code == 0, err
    assert "resolved recipe:" in out and "[3/3]" in out
    return directory / "art"


def test_generate_json_lines(artifact):
    code, out, _ = run("generate", artifact, "hello", "abc", "--max-tokens", "5", "--json")
    assert code == 0
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["prompt"] for r in records] == ["hello", "abc"]
    for record in records:
        assert len(record["token_ids"]) <= 5 and record["finish_reason"] in ("stop", "length")
        assert isinstance(record["text"], str)


def test_eval_and_bench_and_inspect(artifact, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    code, out, _ = run("eval", artifact, "--text", text, "--windows", "2", "--seq-len", "32",
                       "--json")
    assert code == 0
    result = json.loads(out)
    assert result["tokens"] == 2 * 31 and result["ppl"] > 1
    code, out, _ = run("bench", artifact, "--batch", "1,2", "--prompt-len", "8", "--gen-len", "4",
                       "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["peak_rss_mib"] > 0 for r in rows)
    code, out, _ = run("inspect", artifact, "--json")
    info = json.loads(out)
    # 3 layers x (key + value) x 2 KV heads x 16 dims x 4 bytes
    assert code == 0 and info["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 4


def test_eval_scores_several_texts_one_row_each(artifact, tmp_path):
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_text("the quick brown fox jumps over the lazy dog " * 20)
    texts[1].write_text("def f(x):\n    return x + 1\n" * 40)
    args = ["eval", artifact, "--text", texts[0], "--text", texts[1], "--windows", "2",
            "--seq-len", "32"]
    code, out, _ = run(*args, "--json")
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert code == 0 and [r["text"] for r in records] == [str(t) for t in texts]
    alone = json.loads(run("eval", artifact, "--text", texts[1], "--windows", "2",
                           "--seq-len", "32", "--json")[1])
    assert records[1]["ppl"] == alone["ppl"] and records[0]["ppl"] != alone["ppl"]
    code, out, _ = run(*args)
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split() == ["text", "perplexity", "tokens", "windows",
                                              "seconds"]
    assert [line.split()[0] for line in lines[1:]] == [str(t) for t in texts]
    assert float(lines[2].split()[1]) == pytest.approx(alone["ppl"], abs=1e-4)


def test_bench_prints_sequences_that_fit_the_pool(artifact):
    code, out, _ = run("bench", artifact, "--batch", "1", "--prompt-len", "8", "--gen-len", "4",
                       "--pool-mib", "1")
    # 768 bytes/token, blocks of 4: 1 MiB holds 341 blocks, one the null block; 12 tokens
    # take three blocks.
    assert code == 0 and "KV cache: 768 bytes/token; 113 sequences of 12 tokens fit in 1 MiB" in out
    assert "kernels: onnxruntime" in out  # a float artifact: the native step does not run it


def test_set_overrides_the_recipe(tiny_checkpoints, tmp_path, artifact):
    recipe = write_recipe(tmp_path, f"model: {tiny_checkpoints['llama']}\n")
    code, out, err = run("compile", recipe, "-o", tmp_path / "fp16",
                         "--set", "target.weight_dtype=float16", "--set", "runtime.max_context=64")
    assert code == 0, err
    manifest = json.loads((tmp_path / "fp16" / "manifest.json").read_text())
    assert manifest["recipe"]["target"]["weight_dtype"] == "float16"
    assert manifest["runtime"]["max_context"] == 64
    fp16 = (tmp_path / "fp16" / "target.onnx.data").stat().st_size
    assert fp16 < 0.6 * (artifact / "target.onnx.data").stat().st_size


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("model: {m}\ncalibration:\n  sample: 3\n", ["recipe.yaml:3", "calibration.sample",
                                                      "unknown key"]),
        ("model: {m}\ntarget: {{weight_dtype: float64}}\n", ["recipe.yaml:2",
                                                             "target.weight_dtype"]),
        ("model: {m}\nruntime:\n  block_size: many\n", ["recipe.yaml:3", "runtime.block_size"]),
        ("model: {m}\npasses:\n  - nonsense: {{}}\n", ["recipe.yaml:3", "unknown pass"]),
        ("model: /no/such/model\n", ["model path not found", "/no/such/model"]),
        ("model: [unclosed\n", ["invalid YAML"]),
    ],
)
def test_bad_recipes_are_one_line_errors(text, needles, tiny_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path, text.format(m=tiny_checkpoints["llama"]))
    code, _, err = run("compile", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_leaves_nothing(tmp_path):
    checkpoint = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(
        checkpoint)
    recipe = write_recipe(tmp_path, f"model: {checkpoint}\n")
    code, _, err = run("compile", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "unsupported architecture", "gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "recipe.yaml"]


def test_corrupt_artifact(artifact, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in artifact.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    data = bytearray((broken / "target.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (broken / "target.onnx.data").write_bytes(bytes(data))
    code, _, err = run("generate", broken, "hi")
    assert_one_line_error(code, err, "corrupt artifact", "target.onnx.data")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["format_version"] = 99
    (broken / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run("inspect", broken)
    assert_one_line_error(code, err, "format_version 99")
    (broken / "manifest.json").write_text("{not json")
    code, _, err = run("generate", broken, "hi")
    assert_one_line_error(code, err, "manifest.json")
    code, _, err = run("generate", tmp_path / "nothing-here", "hi")
    assert_one_line_error(code, err, "not an llmopt artifact")


def test_prompt_longer_than_the_context(artifact):
    code, _, err = run("generate", artifact, "x" * 100)
    assert_one_line_error(code, err, "100", "64")


def test_zero_size_pool(artifact):
    code, _, err = run("generate", artifact, "hi", "--num-blocks", "0")
    assert_one_line_error(code, err, "block")


@pytest.mark.parametrize(("args", "message"), [
    (["eval", "{a}", "--text", "{t}", "--windows", "0"], "0 is not in the range x>=1"),
    (["eval", "{a}", "--text", "{t}", "--seq-len", "0"], "0 is not in the range x>=1"),
    (["eval", "{a}", "--text", "/nonexistent"], "'/nonexistent' does not exist"),
    (["bench", "{a}", "--batch", "abc"], "'abc' is not a comma-separated list of integers"),
    (["bench", "{a}", "--batch", "0"], "'0' needs one or more integers >= 1"),
    (["generate", "{a}", "hi", "--threads", "0"], "0 is not between 1 and this machine's"),
    (["generate", "{a}", "hi", "--threads", "1000"], "1000 is not between 1 and this machine's"),
    (["generate", "{a}", "hi", "--max-context", "0"], "0 is not in the range x>=1"),
    (["generate", "{a}", "hi", "--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["inspect", "{a}", "--pool-mib", "-1"], "-1.0 is not in the range x>0"),
])
def test_bad_numbers_are_named_before_the_model_loads(artifact, word_text, args, message):
    argv = [a.format(a=artifact, t=word_text) for a in args]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code != 0
    assert message in result.output


def test_draft_trees_where_they_cannot_run_are_one_line_errors(artifact):
    code, _, err = run("generate", artifact, "hi", "--draft-tree", "--kernels", "onnxruntime")
    assert_one_line_error(code, err, "draft_tree needs a target that runs draft trees")


def test_a_binary_text_file_is_named(artifact, tmp_path):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    result = CliRunner().invoke(main, ["eval", str(artifact), "--text", str(binary)])
    assert result.exit_code == 1
    assert f"error: {binary} is not UTF-8 text (byte 0 cannot be decoded)" in result.output


@pytest.mark.parametrize(("override", "message"), [
    ("model.x=1", "error: --set model.x: model is a str, not a section with keys"),
    ("passes.3.rtn.bits=8", "error: --set passes.3.rtn.bits: passes.3 is not an index of a "
                            "1-item list"),
])
def test_set_paths_that_do_not_fit_are_named(tmp_path, override, message):
    recipe = write_recipe(tmp_path, "model: m\npasses:\n  - rtn: {}\n")
    code, _, err = run("compile", recipe, "-o", tmp_path / "out", "--set", override)
    assert_one_line_error(code, err, message)


def test_sigterm_during_the_write_leaves_no_staging_folder(tmp_path):
    import subprocess
    import sys

    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from llmopt.cli import _exit_on_sigterm\n"
        "from llmopt.compiler.artifact import staging_directory\n"
        "_exit_on_sigterm()\n"
        f"with staging_directory(Path({str(tmp_path / 'out')!r})) as staging:\n"
        "    (staging / 'partial.onnx').write_bytes(b'x' * 1000)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert result.returncode == 128 + 15
    assert list(tmp_path.iterdir()) == []


def test_bad_prompts_are_named(artifact):
    from llmopt.runtime import LLM

    with pytest.raises(ValueError, match="score needs at least 2 token ids"):
        LLM(artifact).score([])
    code, _, err = run("generate", artifact, "ok", "\udcff\udcfe hello")
    assert_one_line_error(code, err, "prompt 2 is not valid UTF-8 text")


def test_plain_outputs_of_several_prompts_are_separated(artifact):
    code, out, _ = run("generate", artifact, "hello", "abc", "--max-tokens", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "=== 1/2 ===" and "=== 2/2 ===" in lines
    code, out, _ = run("generate", artifact, "hello", "--max-tokens", "3")
    assert code == 0 and "===" not in out


def test_compile_log_has_no_third_party_progress_bars(tiny_checkpoints, tmp_path):
    import subprocess
    import sys

    recipe = write_recipe(tmp_path, f"model: {tiny_checkpoints['llama']}\n")
    result = subprocess.run([sys.executable, "-c", "from llmopt.cli import main; main()",
                             "compile", str(recipe), "-o", str(tmp_path / "art")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "[3/3]" in result.stdout
    assert "Loading weights" not in result.stderr and "%|" not in result.stderr


def test_a_gguf_compile_log_has_no_dequantizing_progress_bar(family_checkpoints, tmp_path):
    import subprocess
    import sys

    recipe = write_recipe(tmp_path, f"model: {family_checkpoints['llama']['gguf']}\n"
                                    "quality: {measure: false}\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TQDM_DISABLE"}
    result = subprocess.run([sys.executable, "-c", "from llmopt.cli import main; main()",
                             "compile", str(recipe), "-o", str(tmp_path / "art")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "de-quantizing" not in result.stderr and "%|" not in result.stderr


def test_a_text_share_without_calibration_text_is_refused_before_loading(tmp_path):
    recipe = write_recipe(tmp_path, f"model: {tmp_path}\npasses:\n  - awq: {{bits: 4}}\n"
                                    "calibration: {model_samples: 0.5}\n")
    code, _, err = run("compile", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "calibration: model_samples 0.5 leaves windows to "
                                     "calibration.text, which is not set")
    assert not (tmp_path / "out").exists()


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, "model: models/smollm2-typo\n")
    code, _, err = run("compile", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "model path not found: models/smollm2-typo")


def test_export_hf_from_a_compiled_artifact(artifact, tmp_path):
    code, out, err = run("export-hf", artifact, "-o", tmp_path / "hf")
    assert code == 0, err
    assert "[1/2] reading the compiled weights of" in out
    assert out.strip().splitlines()[-1] == (f"load with AutoModelForCausalLM.from_pretrained("
                                            f"{str(tmp_path / 'hf')!r}) (plain float weights)")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize(("args", "message"), [
    (["{a}", "-o", "{a}"], "error: {a} exists; not replacing it"),
    (["{a}", "-o", "{t}/new", "--set", "passes.0.rtn.bits=8"],
     "error: --set overrides a recipe; SOURCE is a compiled artifact"),
    (["{t}", "-o", "{t}/new"], "error: {t} is a folder but not an llmopt artifact "
                               "(manifest.json is missing)"),
    (["{a}", "-o", "{t}/new", "--format", "gguf"], "error: unknown export format 'gguf' "
                                                   "(known: compressed-tensors, gptq, "),
])
def test_export_hf_refusals_are_one_line(artifact, tmp_path, args, message):
    code, _, err = run("export-hf", *[a.format(a=artifact, t=tmp_path) for a in args])
    assert_one_line_error(code, err, message.format(a=artifact, t=tmp_path))
    assert not (tmp_path / "new").exists()


def test_export_formats_are_spelled_as_the_exporter_spells_them():
    from llmopt.cli import EXPORT_FORMATS as CLI_FORMATS
    from llmopt.compiler.hf_export import EXPORT_FORMATS

    assert CLI_FORMATS == EXPORT_FORMATS


def test_a_dry_run_names_a_missing_model_and_writes_nothing(tmp_path):
    recipe = write_recipe(tmp_path, "model: ./models/smollm2-typo\n")
    code, out, err = run("compile", recipe, "-o", tmp_path / "out", "--dry-run")
    assert_one_line_error(code, err, "error: model path not found: ./models/smollm2-typo")
    assert "resolved recipe:" in out and not (tmp_path / "out").exists()


def test_every_option_of_every_command_has_help_text():
    import click

    missing = [f"{name} {param.opts[0]}" for name, command in main.commands.items()
               for param in command.params
               if isinstance(param, click.Option) and param.name != "help" and not param.help]
    assert missing == []


def test_the_output_folder_is_checked_before_the_passes_options(tmp_path):
    (tmp_path / "mine").mkdir()
    recipe = write_recipe(tmp_path, f"model: {tmp_path}\npasses:\n  - awq: {{bits: 3}}\n")
    code, _, err = run("compile", recipe, "-o", tmp_path / "mine")
    assert_one_line_error(code, err, "is not an llmopt artifact; not replacing it")


def test_generate_says_its_kernels_threads_and_a_cut_answer_on_stderr(artifact):
    code, out, err = run("generate", artifact, "hello", "--max-tokens", "3", "--threads", "1")
    assert code == 0 and "kernels" not in out
    assert err.splitlines() == ["kernels: onnxruntime; threads: 1",
                                "note: stopped at --max-tokens 3; raise it for a longer answer"]


def test_streaming_flags_refuse_what_cannot_stream_in_one_line(artifact):
    """--window past the context; H2O on float weights (no native step) from a graph that
    returns no attention weights. (--window streams them: their manifest names the rotary
    tables.)"""
    code, _, err = run("generate", artifact, "hello", "--window", "100", "--max-tokens", "2")
    assert_one_line_error(code, err, "larger than the context")
    code, _, err = run("generate", artifact, "hello", "--window", "28", "--max-tokens", "2")
    assert code == 0, err
    code, _, err = run("generate", artifact, "hello", "--h2o", "28", "--max-tokens", "2")
    assert_one_line_error(code, err, "h2o needs attention weights")
    code, _, err = run("generate", artifact, "hello", "--h2o", "28", "--window", "28")
    assert_one_line_error(code, err, "choose one of --window and --h2o")
