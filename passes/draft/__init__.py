"""Draft pairing for speculative decoding, the library of the compiler's draft pairing
phase (`llmopt.compiler.draft_pairing`): build (or load) a draft, gather the n-gram
drafter's corpus, measure the pairing against the final target, and choose γ.

Recipe: `- draft: {kind: model|self|tiny|ngram, gamma: auto|N, passes: [...], ...}`; each
kind's options are its type in `config.py`. Model drafts also take `head_vocab: N` (keep
the LM head's N most frequent calibration tokens, FR-Spec), `distill_steps` (KL to the
target on `calibration.text`) and `distill_data: text|self`: text windows, or the
target's own greedy continuations of `distill_prompts` prompts (`distill_new_tokens`
each; see `data.py`). The recipe lists it last (the registry says so): the phase runs
after the passes and measures against the target as the artifact will run it.

The phase hands these functions what they need (`PairingInputs`): the recipe, its log,
and how to run a model as the artifact will hold it; they never lower a graph themselves.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.compiler.calibration_mix import calibration_windows
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes.draft import model as dm
from llmopt.passes.draft.config import (
    MAX_GAMMA,
    Config,
    DraftModelConfig,
    NgramOptions,
    TinyDraft,
)
from llmopt.passes.draft.config import (
    make_config as make_config,  # the config of one kind, from its options
)
from llmopt.passes.draft.distill import DistillSettings, distill, text_windows
from llmopt.runtime.executors.step_batch import Executor
from llmopt.runtime.kv.paging import cdiv

# (model, graph path, pool blocks, blocks per lane) -> the model lowered as the artifact
# will hold it, run as the runtime runs it by default
ExecutorFor = Callable[[ModelIR, Path, int, int], Executor]


@dataclass(frozen=True)
class PairingInputs:
    """What pairing a draft reads besides the target and the config."""

    recipe: Recipe
    log: Callable[[str], None]
    executor: ExecutorFor


def ngram_corpus(ir: ModelIR, config: Config, inputs: PairingInputs,
                 report: dict[str, Any]) -> list[int] | None:
    """The suffix drafter's corpus in target ids: a text file's first tokens, or the
    target's own greedy answers (`corpus: self`)."""
    if config.corpus is None:
        return None
    started = time.perf_counter()
    if config.corpus != "self":
        if not Path(config.corpus).is_file():
            raise ValueError(f"draft corpus: file not found: {config.corpus}")
        tokens = list(ir.text_token_ids(config.corpus))[: config.corpus_max_tokens]
    else:
        from llmopt.passes.draft import data
        from llmopt.passes.draft.choice import target_tokenizer
        from llmopt.passes.draft.measure import PagedRunner

        recipe = inputs.recipe
        block_size = recipe.runtime.block_size
        prompts = data.self_prompts(ir, target_tokenizer(ir), config.corpus_prompts,
                                    recipe.calibration.text)
        longest = max(len(p) for p in prompts) + config.corpus_new_tokens
        blocks = cdiv(longest, block_size)
        with tempfile.TemporaryDirectory(prefix="llmopt-corpus-") as tmp:
            target = inputs.executor(ir, Path(tmp) / "target.onnx",
                                     1 + data.GENERATION_BATCH * blocks, blocks)
            trajectories = data.generate(lambda _: PagedRunner(target, block_size, blocks),
                                         prompts, config.corpus_new_tokens,
                                         ir.arch.eos_token_ids)
        tokens = [t for traj in trajectories for t in traj.tokens]  # prompts too: they
        # hold the phrasing that answers repeat
    report["ngram_corpus"] = {"source": config.corpus, "tokens": len(tokens),
                              "seconds": round(time.perf_counter() - started, 1)}
    inputs.log(f"      n-gram corpus: {len(tokens)} tokens from {config.corpus}")
    return tokens


# --- building the draft --------------------------------------------------------------------
def build_draft(ir: ModelIR, config: DraftModelConfig, inputs: PairingInputs,
                report: dict[str, Any]) -> tuple[ModelIR, torch.Tensor | None]:
    """The draft IR for `config.kind`, head-trimmed and distilled as asked."""
    steps = config.steps()
    windows, mask, own = None, None, None
    if config.distill_data == "self" and (steps or config.head_vocab or config.kind == "tiny"):
        data = _self_windows(ir, config, inputs)
        windows, mask, own = data.ids, data.mask, data.ids[:, 1:][data.mask[:, :-1] > 0]
        report["distill_data"] = data.report
    elif steps or config.head_vocab or config.kind == "tiny":
        windows = _calibration_windows(ir, config, inputs)
    token_map = None
    if config.kind == "model":
        draft, token_map = dm.map_to_target(_load(config.model), ir)
        report["vocabulary"] = "identical" if token_map is None else "mapped subset"
    elif config.kind == "self":
        draft = dm.truncated(ir, config.layers or max(1, ir.arch.num_layers // 4))
    else:
        draft = _tiny(ir, config, windows)
    if config.head_vocab:
        keep = dm.frequent_tokens(_frequency_ids(ir, config, inputs, windows),
                                  config.head_vocab, _special_ids(ir), ir.arch.vocab_size,
                                  first=own)
        draft, token_map = dm.trim_head(draft, token_map, keep)
    if steps:
        settings = DistillSettings(steps, config.lr(), config.distill_batch_size,
                                   config.trainable)
        inputs.log(f"      distilling the {config.kind} draft: {steps} steps of "
                   f"{config.distill_batch_size} x {windows.shape[1]} tokens "
                   f"({config.distill_data} data)")
        draft, report["distillation"] = distill(draft, ir, windows, token_map, settings,
                                                inputs.log, mask)
    return draft, token_map


def _load(model: str | None) -> ModelIR:
    from llmopt.compiler.loader import load_checkpoint

    return load_checkpoint(str(model))

def _calibration_windows(ir: ModelIR, config: DraftModelConfig,
                         inputs: PairingInputs) -> torch.Tensor:
    """Every window of calibration.text; without one, the target's own samples
    (calibration.samples of them, compiler/calibration_mix.py)."""
    calibration = inputs.recipe.calibration
    if calibration.text is None:
        return calibration_windows(ir, calibration.model_copy(
            update={"seq_len": config.distill_seq_len}), inputs.log)
    return text_windows(ir, calibration.text, config.distill_seq_len)


def _self_windows(ir: ModelIR, config: DraftModelConfig, inputs: PairingInputs) -> Any:
    """The target's greedy continuations of built prompts, generated through ONNX Runtime
    on the lowered target (far faster than the torch reference)."""
    from llmopt.passes.draft import data as draft_data
    from llmopt.passes.draft.choice import target_tokenizer
    from llmopt.passes.draft.measure import PagedRunner

    recipe = inputs.recipe
    block_size = recipe.runtime.block_size
    max_len = min(ir.arch.max_position, recipe.runtime.max_context)
    new_tokens = min(config.distill_new_tokens, max_len // 2)
    blocks = cdiv(max_len, block_size)
    inputs.log(f"      generating distillation data: {config.distill_prompts} prompts x "
               f"{new_tokens} greedy target tokens")
    with tempfile.TemporaryDirectory(prefix="llmopt-draft-data-") as tmp:
        batch = draft_data.GENERATION_BATCH
        target = inputs.executor(ir, Path(tmp) / "target.onnx", 1 + batch * blocks, blocks)

        def runner_for(longest: int) -> PagedRunner:
            return PagedRunner(target, block_size, cdiv(longest, block_size))

        data = draft_data.self_windows(ir, target_tokenizer(ir), runner_for,
                                       config.distill_prompts, new_tokens,
                                       recipe.calibration.text, max_len)
    inputs.log(f"      {data.report['continuation_tokens']} continuation tokens in "
               f"{data.report['generation_seconds']} s")
    return data


def _frequency_ids(ir: ModelIR, config: DraftModelConfig, inputs: PairingInputs,
                   windows: torch.Tensor) -> torch.Tensor:
    """Token ids whose counts rank the LM head rows: the windows, and with self data the
    calibration text too (the continuations alone hold too few distinct tokens)."""
    if config.distill_data == "self" and inputs.recipe.calibration.text is not None:
        return torch.cat([windows.flatten(), _calibration_windows(ir, config, inputs).flatten()])
    return windows


def _special_ids(ir: ModelIR) -> tuple[int, ...]:
    ids = [*ir.arch.eos_token_ids, ir.arch.bos_token_id]
    return tuple(i for i in ids if i is not None and i < ir.arch.vocab_size)


def _tiny(ir: ModelIR, config: TinyDraft, windows: torch.Tensor) -> ModelIR:
    arch, spec = ir.arch, ir.arch.layers[0]
    kv_heads = config.num_kv_heads or max(1, spec.num_kv_heads // 2)
    shape = dm.TinyShape(
        hidden_size=config.hidden_size or arch.hidden_size // 2,
        num_layers=config.num_layers,
        num_heads=config.num_heads or kv_heads * (spec.num_heads // spec.num_kv_heads),
        num_kv_heads=kv_heads,
        intermediate_size=config.intermediate_size or arch.intermediate_size // 3,
    )
    basis = dm.residual_basis(ir, _residual_states(ir, windows[-2:]), shape.hidden_size)
    return dm.sliced_tiny(ir, shape, basis, dm.evenly_spaced(shape.num_layers, arch.num_layers))


@torch.no_grad()
def _residual_states(ir: ModelIR, windows: torch.Tensor) -> torch.Tensor:
    """[tokens * (layers + 1), hidden]: the target's residual stream at every layer input
    and at the final norm, over `windows`."""
    model = ReferenceModel(ir, windows.shape[1])
    positions = torch.arange(windows.shape[1])
    hidden = model.embed(windows)
    states = [hidden]
    for index in range(ir.arch.num_layers):
        hidden = model.layer_forward(index, hidden, positions, None)
        states.append(hidden)
    return torch.cat(states).reshape(-1, ir.arch.hidden_size)


def draft_summary(draft: ModelIR, token_map: torch.Tensor | None) -> dict[str, Any]:
    return {"source": draft.source, "layers": draft.arch.num_layers,
            "hidden_size": draft.arch.hidden_size, "vocab_size": draft.arch.vocab_size,
            "token_map": token_map is not None, "parameters": draft.num_parameters()}


# --- measuring the pairing -------------------------------------------------------------
def measure_pairing(ir: ModelIR, draft: ModelIR | None, token_map: torch.Tensor | None,
                    config: Config, inputs: PairingInputs,
                    corpus: list[int] | None = None) -> dict[str, Any]:
    """Run target (and draft) from a temporary directory, as the artifact will hold them,
    and measure them there."""
    from llmopt.passes.draft import choice as m
    from llmopt.runtime.executors.choose import kernels_name

    recipe = inputs.recipe
    block_size = recipe.runtime.block_size
    prompts = m.calibration_prompts(ir, config.prompts, recipe.calibration.text)
    max_position = min(ir.arch.max_position, recipe.runtime.max_context)
    new_tokens = min(config.new_tokens, max_position - max(len(p) for p in prompts))
    context_len = min(config.context_len, max_position - MAX_GAMMA - 1)
    ngram = config.ngram_options()
    settings = m.MeasureSettings(
        prompts=prompts, new_tokens=new_tokens, batch_sizes=config.batch_sizes,
        context_len=context_len, repeats=config.cost_repeats, max_gamma=MAX_GAMMA,
        gamma=None if config.gamma == "auto" else config.gamma,
        ngram=_ngram_lookup(ngram, corpus), min_speedup=config.min_speedup,
        block_size=block_size, eos_ids=ir.arch.eos_token_ids)
    longest = max(len(p) for p in prompts) + new_tokens
    seq_blocks = max(cdiv(longest, block_size), cdiv(context_len + MAX_GAMMA + 1, block_size))
    num_blocks = 1 + max(len(prompts), config.batch_sizes[-1]) * seq_blocks
    inputs.log(f"      measuring: {len(prompts)} prompts x {new_tokens} greedy tokens, step "
               f"costs at batch {config.batch_sizes}")
    with tempfile.TemporaryDirectory(prefix="llmopt-draft-") as tmp:
        target = inputs.executor(ir, Path(tmp) / "target.onnx", num_blocks, seq_blocks)
        draft_exec = None if draft is None else inputs.executor(
            draft, Path(tmp) / "draft.onnx", num_blocks, seq_blocks)
        mapping = None if token_map is None else token_map.numpy()
        spec = m.measure(target, draft_exec, mapping, settings)
        spec["measured"]["kernels"] = kernels_name(target)
        return spec


def _ngram_lookup(ngram: NgramOptions | None, corpus: list[int] | None) -> Any:
    """The runtime's n-gram drafter's lookup, for the simulation (None: no n-gram)."""
    if ngram is None:
        return None
    from llmopt.runtime.manifest import NgramDraftSpec
    from llmopt.runtime.speculative.speculator import make_ngram_drafter

    spec = NgramDraftSpec.model_validate(ngram.model_dump())
    array = None if corpus is None else np.asarray(corpus, dtype=np.int64)
    return make_ngram_drafter(None, spec, array).lookup


def log_summary(spec: dict[str, Any], log: Callable[[str], None]) -> None:
    alphas = ", ".join(f"{a:.2f}" for a in spec["acceptance"][:4])
    log(f"      draft: α {alphas} ...; cost ratio {spec['cost_ratio']}; γ {spec['gamma']}; "
        f"predicted speedup {spec['predicted_speedup']}x at batch 1; speculation up to batch "
        f"{spec['max_batch_size']}")

