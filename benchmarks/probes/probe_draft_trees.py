"""Would draft trees pay on SmolLM2? A measurement before building them (#15).

The artifact's suffix n-gram drafter proposes one chain: at each step the most frequent
follower of the longest matching context. A tree keeps several followers per position;
one target pass verifies all of them (a tree attention mask), and the longest path the
target agrees with is accepted. Here both are walked along the artifact's own greedy
continuations of the fixed prompt mixes (`bench_speculative.encode_mix`), without
running any tree on the target: greedy acceptance of a proposal is exactly its agreement
with the continuation, path by path.

Drafts, each at a budget of k = 1..`--max-nodes` draft tokens per step:
- `chain`: the runtime's `suffix_draft`, as the artifact drafts today;
- `backoff`: the tree, its candidates also taking the followers of shorter contexts;
- `tree`: the runtime's `suffix_tree` (`draft_tree=True`): best-first growth over the
  same follower counts; every candidate node scores the product of its path's follower
  frequencies; the highest-scoring candidates are kept until k nodes or
  `min_confidence`, at most as deep as the chain may draft;

Each (budget, draft) is priced with the artifact's measured batch-1 step of 1 + nodes
query tokens at a 128-token context (a tree's mask costs nothing extra in that model:
the step reads the same rows). Reported: tokens per target step, α of the first
position, and the batch-1 speedup implied; the best budget of each family side by side.
Prints a table; writes benchmarks/results/probe_draft_trees.json.

    python benchmarks/probes/probe_draft_trees.py ART --mixes v2,old --gen 64
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common and the benchmarks
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from bench_speculative import encode_mix  # noqa: E402

from llmopt.passes.draft.measure import timed_step  # noqa: E402
from llmopt.runtime import LLM, SamplingParams  # noqa: E402
from llmopt.runtime.speculative.speculator import make_ngram_drafter  # noqa: E402
from llmopt.runtime.speculative.suffix import (  # noqa: E402
    NgramIndex,
    SuffixSettings,
    suffix_draft,
    suffix_tree,
)

Tree = tuple[list[int], list[int]]  # (tokens, parent index; -1 = the last known token)


def backoff_counts(context: Sequence[int], indexes: Sequence[tuple[str, NgramIndex]],
                   settings: SuffixSettings) -> dict[int, int] | None:
    """Followers of the longest match, and below them those of every shorter matching
    context that the longer ones did not name (each scaled to half the longest match's
    total), so a branch can take what a shorter context saw follow."""
    tail = list(context[-settings.max_n:])
    merged: dict[int, float] = {}
    total = None
    for n in range(min(settings.max_n, len(tail)), settings.min_n - 1, -1):
        key = tuple(tail[len(tail) - n:])
        for _, index in indexes:
            counts = index.followers.get(key) if n <= index.max_n else None
            if not counts:
                continue
            scale = 1.0 if total is None else 0.5 * total / sum(counts.values())
            total = total if total is not None else sum(counts.values())
            for token, count in counts.items():
                merged.setdefault(token, count * scale)
    return merged or None


def accepted_on_tree(tree: Tree, truth: Sequence[int]) -> int:
    """Greedy acceptance: the longest root path whose tokens are the continuation's."""
    tokens, parents = tree
    depth = {-1: 0}
    best = 0
    for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        d = depth.get(parent)
        if d is not None and d < len(truth) and truth[d] == token:
            depth[i] = d + 1
            best = max(best, d + 1)
    return best


def walk(trajectories: list[tuple[list[int], int]], drafter, k: int, kind: str
         ) -> list[tuple[int, int]]:
    """(nodes proposed, accepted) per target step along each continuation."""
    steps = []
    for tokens, prompt_len in trajectories:
        index = NgramIndex(drafter.settings.max_n)
        t = prompt_len
        while t < len(tokens):
            index.sync(tokens[:t])
            indexes = [("ngram", index)] + ([("corpus", drafter.corpus)]
                                            if drafter.corpus else [])
            family, _, confidence = kind.partition("@")
            settings = (dataclasses.replace(drafter.settings, min_confidence=float(confidence))
                        if confidence else drafter.settings)
            if family == "chain":
                chain = suffix_draft(tokens[:t], indexes, k, settings)[0]
                tree: Tree = (chain, list(range(-1, len(chain) - 1)))
            else:
                followers = ((lambda tail, i=indexes, s=settings: backoff_counts(tail, i, s))
                             if family == "backoff" else None)
                tree = suffix_tree(tokens[:t], indexes, k, settings, followers)[:2]
            accepted = min(accepted_on_tree(tree, tokens[t:]), len(tokens) - t - 1)
            steps.append((len(tree[0]), accepted))
            t += accepted + 1
    return steps


def summarize(steps: list[tuple[int, int]], cost: dict[int, float]) -> dict[str, Any]:
    emitted = sum(a + 1 for _, a in steps)
    seconds = sum(cost[min(1 + n, max(cost))] for n, _ in steps)
    drafted = [a for n, a in steps if n]
    return {"tokens_per_step": round(emitted / len(steps), 3),
            "speedup": round(emitted * cost[1] / seconds, 3),
            "drafting_share": round(len(drafted) / len(steps), 3),
            "alpha_first": round(sum(a >= 1 for a in drafted) / max(1, len(drafted)), 3),
            "nodes_per_step": round(sum(n for n, _ in steps) / len(steps), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="an artifact with a suffix n-gram draft")
    parser.add_argument("--mixes", default="v2,old")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--max-nodes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--confidences", default="0.1,0.2",
                        help="min_confidence values tried besides the artifact's own")
    args = parser.parse_args()
    llm = LLM(args.artifact, speculative=False, num_threads=args.threads)
    spec = llm.manifest.speculative
    if spec is None or spec.ngram is None or spec.ngram.method != "suffix":
        raise SystemExit(f"{args.artifact} has no suffix n-gram draft")
    drafter = make_ngram_drafter(args.artifact, spec.ngram)
    params = SamplingParams(temperature=0.0, max_tokens=args.gen)
    results: dict[str, Any] = {}
    cost_runs = {n: timed_step(llm.engine.executor, 1, n, 128, llm.engine.config.block_size)
                 for n in range(1, args.max_nodes + 2)}
    cost = {n: min(run() for _ in range(30)) for n, run in cost_runs.items()}
    kinds = ["chain", "tree", "backoff"] + [
        f"{family}@{c}" for c in args.confidences.split(",") if c
        for family in ("chain", "tree", "backoff")]
    for mix in args.mixes.split(","):
        encoded = encode_mix(llm.tokenizer, mix)
        per_category: dict[str, list[tuple[list[int], int]]] = {}
        for category, prompts in encoded.items():
            outputs = llm.generate(prompts, params)
            per_category[category] = [(p + o.token_ids, len(p))
                                      for p, o in zip(prompts, outputs, strict=True)]
        per_category["all"] = [t for trajs in per_category.values() for t in trajs]
        results[mix] = {
            category: {kind: {k: summarize(walk(trajs, drafter, k, kind), cost)
                              for k in range(1, args.max_nodes + 1)}
                       for kind in kinds}
            for category, trajs in per_category.items()}
    print("step cost / 1-token step: " + ", ".join(
        f"{n}: {cost[n] / cost[1]:.2f}" for n in cost))
    for mix, per in results.items():
        print(f"\nmix {mix}: best budget per draft (speedup, tokens/step, nodes/step, α1)")
        print(f"{'category':<12}" + "".join(f"{kind:>34}" for kind in kinds))
        for category, kinds in per.items():
            cells = []
            for kind in kinds:
                k, best = max(kinds[kind].items(), key=lambda kv: kv[1]["speedup"])
                cells.append(f"k{k:<2} {best['speedup']:.3f}x {best['tokens_per_step']:.2f}t "
                             f"{best['nodes_per_step']:.1f}n a{best['alpha_first']:.2f}")
            print(f"{category:<12}" + "".join(f"{c:>34}" for c in cells))
        for kind in kinds:
            print(f"all, {kind:<10} by budget k: " + " ".join(
                f"{per['all'][kind][k]['speedup']:.3f}" for k in range(1, args.max_nodes + 1)))
    write_json(RESULTS_DIR / "probe_draft_trees.json", {
        "machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
        "step_costs": cost, "results": results})


if __name__ == "__main__":
    main()
