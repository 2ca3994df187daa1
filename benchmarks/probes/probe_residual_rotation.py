"""Does a residual-stream rotation before int4 weights (QuaRot / SpinQuant style) help
SmolLM2-135M? Scored as `quality_domains.py` scores (its texts, tuning split by default).

The rotation is exact in float: each RMSNorm's weight is folded into the linears that read
it (the norms become ones), the residual stream is turned by an orthogonal Q (embedding
E Q, readers W Q, writers Qᵀ W, the head untied as diag(final norm) folded then Q), and
each head's values and o_proj's inputs by a Hadamard matrix. Then a weight pass runs on
the rotated model. Configurations are ROTATION:PASS, for example `none:rtn,random:rtn`:

    python benchmarks/probes/probe_residual_rotation.py none:rtn,fold:rtn,random:rtn
    python benchmarks/probes/probe_residual_rotation.py none:gptq,random:gptq \\
        --calibration-json '{"samples": 32}'

ROTATION: none, fold (the norms folded, Q the identity), random (a seeded random
orthogonal Q), hadamard (block Hadamard of the largest power of two dividing hidden, random
signs); add `-noheads` to skip the per-head Hadamard. PASS: a `quality_domains.py` config,
or `float` (the rotated float model itself: checks the rotation is exact). A rotated model
calibrates on the samples the unrotated model draws (it is the same function).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import quality_domains as qd  # noqa: E402

from llmopt.compiler import calibration_mix  # noqa: E402
from llmopt.compiler.ir import ModelIR  # noqa: E402
from llmopt.compiler.kv_cache_format import hadamard  # noqa: E402
from llmopt.compiler.loader import load_checkpoint  # noqa: E402
from llmopt.compiler.model_samples import SampleMemo, fingerprint, memoized_samples  # noqa: E402
from llmopt.compiler.reference import ReferenceModel  # noqa: E402

READERS = {"attn_norm": ("q_proj", "k_proj", "v_proj"), "mlp_norm": ("gate_proj", "up_proj")}
WRITERS = ("o_proj", "down_proj")


def orthogonal(size: int, kind: str, seed: int) -> torch.Tensor:
    """An orthogonal [size, size] float64 matrix of the named kind."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "fold":
        return torch.eye(size, dtype=torch.float64)
    if kind == "random":
        q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))
    if kind == "hadamard":
        block = size & -size
        h = torch.from_numpy(hadamard(block)).double()
        signs = torch.randint(0, 2, (size,), generator=generator).double() * 2 - 1
        return signs[:, None] * torch.block_diag(*[h] * (size // block))
    raise SystemExit(f"unknown rotation {kind!r}")


def rotate(ir: ModelIR, kind: str, heads: bool, seed: int = 0) -> ModelIR:
    """`ir` with its residual stream turned by an orthogonal matrix (float outputs equal)."""
    out, arch, w = ir.copy(), ir.arch, ir.weights
    q = orthogonal(arch.hidden_size, kind, seed)
    embed = w["embed_tokens"].double()
    head = embed if arch.tie_word_embeddings else w["lm_head.weight"].double()
    out.weights["lm_head.weight"] = (head * w["final_norm"].double() @ q).float()
    out.weights["final_norm"] = torch.ones(arch.hidden_size)
    out.weights["embed_tokens"] = (embed @ q).float()
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        for norm, readers in READERS.items():
            for name in readers:
                key = p + name + ".weight"
                out.weights[key] = (w[key].double() * w[p + norm].double() @ q).float()
            out.weights[p + norm] = torch.ones(arch.hidden_size)
        for name in WRITERS:
            for suffix in (".weight", ".bias"):
                if p + name + suffix in w:
                    out.weights[p + name + suffix] = (q.T @ w[p + name + suffix].double()).float()
        if heads:
            _rotate_values(out, i)
    out.arch = dataclasses.replace(arch, tie_word_embeddings=False)
    return out


def _rotate_values(ir: ModelIR, index: int) -> None:
    """Each head's values turned by a Hadamard matrix, o_proj's inputs turned back."""
    spec, hidden, p = ir.arch.layers[index], ir.arch.hidden_size, f"layers.{index}."
    h = torch.from_numpy(hadamard(spec.head_dim)).double()
    v = ir.weights[p + "v_proj.weight"].double().reshape(spec.num_kv_heads, spec.head_dim, -1)
    ir.weights[p + "v_proj.weight"] = torch.einsum("ij,hjn->hin", h, v).reshape(-1, hidden).float()
    o = ir.weights[p + "o_proj.weight"].double().reshape(hidden, spec.num_heads, spec.head_dim)
    ir.weights[p + "o_proj.weight"] = torch.einsum("nhj,ij->nhi", o, h).reshape(hidden, -1).float()


def share_samples(source: ModelIR, rotated: ModelIR, calibration: dict | None) -> None:
    """Let `rotated` calibrate on the samples `source` draws (the memo keyed to it)."""
    samples = calibration.get("samples", 128) if calibration else 128
    drawn = memoized_samples(source, samples, qd.SEQ_LEN, calibration_mix.SAMPLE_SEED)
    SampleMemo.key = (fingerprint(rotated), qd.SEQ_LEN, calibration_mix.SAMPLE_SEED)
    SampleMemo.samples = drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", help="comma-separated ROTATION:PASS")
    parser.add_argument("--split", choices=qd.SPLIT_WINDOWS, default="tuning")
    parser.add_argument("--calibration-json", default=None)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/llmopt-quality-domains"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calibration = json.loads(args.calibration_json) if args.calibration_json else None
    ir = load_checkpoint(qd.MODEL)
    count = qd.SPLIT_WINDOWS[args.split]
    texts = {t: qd.text_windows(ir, t, args.split, count) for t in qd.TEXTS}
    base = ReferenceModel(ir, qd.SEQ_LEN)
    hidden = {t: qd.cached_hidden(base, w, args.cache) for t, w in texts.items()}
    SampleMemo.directory = args.cache
    for config in args.configs.split(","):
        kind, _, pass_name = config.partition(":")
        model = ir if kind == "none" else rotate(ir, kind.split("-")[0], "noheads" not in kind)
        if pass_name != "float":
            passes = [dict(p) for p in qd.CONFIGS[pass_name]]
            if model is not ir and any(qd.PASSES[name].calibrates for p in passes for name in p):
                share_samples(ir, model, calibration)
            model, *_ = qd.run_config(model, passes, calibration)
        scores = {t: qd.score(base, hidden[t], ReferenceModel(model, qd.SEQ_LEN), w)
                  for t, w in texts.items()}
        print(f"{config:24s} " + "  ".join(
            f"{t} {s['ppl_increase_pct']:+.2f} % KL {s['kl']:.4f}" for t, s in scores.items()),
            flush=True)


if __name__ == "__main__":
    main()
