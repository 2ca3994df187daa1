"""Speculative decoding at run time: one home.

- `drafter`: what proposes draft tokens (n-gram lookup, the artifact's draft graph);
- `rejection_sampler`: the exact acceptance rule;
- `cost_model`: what a speculative step costs and emits (shared with the compiler's
  draft pass, which chooses γ with the same formulas);
- `policy`: how many drafts each sequence takes, from its acceptance and their price;
- `step_cost`: what a whole step costs, its calls padded as the executors pad them;
- `speculator`: ties them together for the engine's step.
"""
