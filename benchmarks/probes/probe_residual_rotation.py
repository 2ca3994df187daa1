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
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import quality_domains as qd  # noqa: E402

from llmopt.compiler.kv_cache_format import hadamard  # noqa: E402
from llmopt.compiler.loader import load_checkpoint  # noqa: E402
from llmopt.compiler.model_samples import SampleMemo  # noqa: E402
from llmopt.compiler.recipe import CalibrationConfig  # noqa: E402
from llmopt.compiler.reference import ReferenceModel  # noqa: E402
from llmopt.passes.rotate import random_orthogonal, rotate_model  # noqa: E402


def orthogonal(size: int, kind: str, seed: int) -> torch.Tensor:
    """An orthogonal [size, size] float64 matrix of the named kind."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "fold":
        return torch.eye(size, dtype=torch.float64)
    if kind == "random":
        return random_orthogonal(size, seed).double()
    if kind == "hadamard":
        block = size & -size
        h = torch.from_numpy(hadamard(block)).double()
        signs = torch.randint(0, 2, (size,), generator=generator).double() * 2 - 1
        return signs[:, None] * torch.block_diag(*[h] * (size // block))
    raise SystemExit(f"unknown rotation {kind!r}")


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
        model = ir if kind == "none" else rotate_model(
            ir, orthogonal(ir.arch.hidden_size, kind.split("-")[0], 0).float(),
            "noheads" not in kind)
        if pass_name != "float":
            passes = [dict(p) for p in qd.CONFIGS[pass_name]]
            if model is not ir and any(qd.PASSES[name].calibrates for p in passes for name in p):
                qd.share_samples(ir, model, CalibrationConfig(**(calibration or {})))
            model, *_ = qd.run_config(model, passes, calibration)
        scores = {t: qd.score(base, hidden[t], ReferenceModel(model, qd.SEQ_LEN), w)
                  for t, w in texts.items()}
        print(f"{config:24s} " + "  ".join(
            f"{t} {s['ppl_increase_pct']:+.2f} % KL {s['kl']:.4f}" for t, s in scores.items()),
            flush=True)


if __name__ == "__main__":
    main()
