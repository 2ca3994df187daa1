"""Does learned rounding (AutoRound: signed gradient descent on each weight's rounding offset
and each group's range, block by block) beat AWQ for int4 g64 weights on SmolLM2-135M?
Scored as `quality_domains.py` scores (its texts, tuning split by default).

Each decoder layer in turn: its linears' int4 weights are W' = s (clamp(round(W / s + V) + z,
0, 15) - z) with s, z from the group's range shrunk by α (max) and β (min); V in [-½, ½] and
α, β in [½, 1] are tuned by sign-SGD (lr 1/steps, decaying linearly) to match the float
layer's output, on batches of the calibration set (the model's own samples). The float layer
reads the float model's hidden states, the quantized one the quantized prefix's, so a layer
also makes up for the error of those below it. The best step's parameters are kept. The LM
head (tied: the embedding) is rounded to nearest at 8 bits, as the weight passes' default.

    python benchmarks/probes/probe_learned_rounding.py --steps 100 --samples 32
    python benchmarks/probes/probe_learned_rounding.py --rotate --steps 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import quality_domains as qd  # noqa: E402

from llmopt.compiler import calibration_mix  # noqa: E402
from llmopt.compiler.ir import ModelIR  # noqa: E402
from llmopt.compiler.loader import load_checkpoint  # noqa: E402
from llmopt.compiler.model_samples import SampleMemo, memoized_samples  # noqa: E402
from llmopt.compiler.quant_format import group_view  # noqa: E402
from llmopt.compiler.reference import LINEARS, ReferenceModel  # noqa: E402
from llmopt.compiler.weight_quant import WeightQuantConfig, fake_quant  # noqa: E402
from llmopt.passes.rotate import random_orthogonal, rotate_model  # noqa: E402

LEVELS = 15  # int4, asymmetric


def round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.round() - x).detach()  # rounds forward, passes gradients through


class LearnedLinear:
    """One linear's weight and its tunable rounding: V [N, K], α and β [N, G]."""

    def __init__(self, w: torch.Tensor, group: int):
        self.groups = group_view(w, group)  # [N, G, group]
        self.shape, self.group = w.shape, group
        self.v = torch.zeros_like(self.groups, requires_grad=True)
        self.alpha = torch.ones(self.groups.shape[:2], requires_grad=True)
        self.beta = torch.ones(self.groups.shape[:2], requires_grad=True)

    def params(self) -> list[torch.Tensor]:
        return [self.v, self.alpha, self.beta]

    def weight(self) -> torch.Tensor:
        w_max = self.groups.amax(-1) * self.alpha
        w_min = self.groups.amin(-1) * self.beta
        scale = ((w_max - w_min) / LEVELS).clamp(min=1e-8)[..., None]
        zero = round_ste(-w_min[..., None] / scale)
        codes = (round_ste(self.groups / scale + self.v) + zero).clamp(0, LEVELS)
        return ((codes - zero) * scale).flatten(1)[:, : self.shape[1]]

    def clamp_(self) -> None:
        with torch.no_grad():
            self.v.clamp_(-0.5, 0.5)
            self.alpha.clamp_(0.5, 1.0)
            self.beta.clamp_(0.5, 1.0)


def tune_layer(model: ReferenceModel, index: int, inputs: list[torch.Tensor],
               targets: list[torch.Tensor], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The layer's fake-quantized weights after `args.steps` sign-SGD steps."""
    prefix = f"layers.{index}."
    base = {n: model.ir.weights[n] for n in model.ir.weights if n.startswith(prefix)}
    learned = {prefix + n + ".weight": LearnedLinear(base[prefix + n + ".weight"], args.group)
               for n in LINEARS}
    params = [p for lin in learned.values() for p in lin.params()]
    positions = torch.arange(inputs[0].shape[1])
    generator = torch.Generator().manual_seed(index)
    best, best_loss = None, float("inf")
    for step in range(args.steps + 1):
        weights = {n: lin.weight() for n, lin in learned.items()}
        model._held = {**base, **weights}
        pick = int(torch.randint(len(inputs), (1,), generator=generator))
        out = model.layer_forward(index, inputs[pick], positions, None)
        loss = torch.nn.functional.mse_loss(out, targets[pick])
        if loss.item() < best_loss:
            best_loss = loss.item()
            best = {n: w.detach().clone() for n, w in weights.items()}
        if step == args.steps:
            break
        for p in params:
            p.grad = None
        loss.backward()
        lr = args.lr * (1 - step / args.steps)
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad.sign()
        for lin in learned.values():
            lin.clamp_()
    model._held = {}
    return best


@torch.no_grad()
def forward_all(model: ReferenceModel, index: int, hidden: list[torch.Tensor],
                weights: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    positions = torch.arange(hidden[0].shape[1])
    prefix = f"layers.{index}."
    held = {n: model.ir.weights[n] for n in model.ir.weights if n.startswith(prefix)}
    model._held = {**held, **(weights or {})}
    out = [model.layer_forward(index, h, positions, None) for h in hidden]
    model._held = {}
    return out


def learned_rounding(ir: ModelIR, windows: torch.Tensor, args: argparse.Namespace) -> ModelIR:
    out = ir.copy()
    model = ReferenceModel(ir, windows.shape[1])
    with torch.no_grad(), model.holding(["embed_tokens"]):
        start = [model.embed(b) for b in windows.split(args.batch)]
    floats, quants = start, [h.clone() for h in start]
    for index in range(ir.arch.num_layers):
        started = time.perf_counter()
        targets = forward_all(model, index, floats)
        weights = tune_layer(model, index, quants, targets, args)
        quants = forward_all(model, index, quants, weights)
        floats = targets
        for name, w in weights.items():
            out.weights[name] = w
        pairs = zip(quants, targets, strict=True)
        loss = sum(float(((q - t) ** 2).mean()) for q, t in pairs) / len(quants)
        print(f"layer {index}: output MSE {loss:.5f} ({time.perf_counter() - started:.1f} s)",
              flush=True)
    head = "embed_tokens" if ir.arch.tie_word_embeddings else "lm_head.weight"
    out.weights[head] = fake_quant(ir.weights[head], WeightQuantConfig(bits=8, group_size=64))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=None, help="default 1/steps")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="windows per step")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rotate", action="store_true")
    parser.add_argument("--split", choices=qd.SPLIT_WINDOWS, default="tuning")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/llmopt-quality-domains"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.lr = args.lr or 1 / args.steps
    torch.set_num_threads(args.threads)
    ir = load_checkpoint(qd.MODEL)
    SampleMemo.directory = args.cache
    windows = memoized_samples(ir, args.samples, qd.SEQ_LEN, calibration_mix.SAMPLE_SEED)
    count = qd.SPLIT_WINDOWS[args.split]
    texts = {t: qd.text_windows(ir, t, args.split, count) for t in qd.TEXTS}
    base = ReferenceModel(ir, qd.SEQ_LEN)
    hidden = {t: qd.cached_hidden(base, w, args.cache) for t, w in texts.items()}
    source = rotate_model(ir, random_orthogonal(ir.arch.hidden_size, 0), True) if (
        args.rotate) else ir
    if args.rotate:  # materialize once: the thunks would redo the rotation every read
        source.weights = {n: source.weights[n] for n in source.weights}
    started = time.perf_counter()
    quantized = learned_rounding(source, windows, args)
    seconds = time.perf_counter() - started
    scores = {t: qd.score(base, hidden[t], ReferenceModel(quantized, qd.SEQ_LEN), w)
              for t, w in texts.items()}
    label = f"learned{'-rot' if args.rotate else ''} steps {args.steps} samples {args.samples}"
    print(f"{label} ({seconds:.0f} s): " + "  ".join(
        f"{t} {s['ppl_increase_pct']:+.2f} % KL {s['kl']:.4f} top-1 {100 * s['top1']:.1f}"
        for t, s in scores.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"label": label, "seconds": seconds, "scores": scores,
                                         "args": {k: str(v) for k, v in vars(args).items()}}))


if __name__ == "__main__":
    main()
