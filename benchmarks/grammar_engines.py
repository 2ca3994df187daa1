"""Constrained-decoding engines side by side: the cost of a token mask on this CPU.

For each engine installed (llguidance, outlines-core, xgrammar), with an artifact's tokenizer
(SmolLM2's 49,152 tokens by default): the one-time tokenizer set-up, each schema's compile
time, and the time to compute one next-token mask, walking the tokens of a valid instance
of each schema (as a model writing it would) from `_json_schemas.schemas(seed)`. Also
whether `import ENGINE` loads torch or transformers (the serving process must not).

    python benchmarks/grammar_engines.py --artifact out/q4_1 [--schemas 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from _json_schemas import random_instance, schemas  # noqa: E402

ENGINES = ("llguidance", "outlines_core", "xgrammar")
IMPORT_CHECK = ("import sys, {0}; print(sorted({{m.split('.')[0] for m in sys.modules}} "
                "& {{'torch', 'transformers'}}))")


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a vocabulary entry uses -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tok: tokenizers.Tokenizer) -> tuple[list[bytes], set[int]]:
    """Each id's bytes, and the ids of special added tokens."""
    decode = byte_decoder()
    vocab = tok.get_vocab(with_added_tokens=True)
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    out = [b""] * len(vocab)
    for text, i in vocab.items():
        out[i] = text.encode() if i in specials else bytes(decode[c] for c in text)
    return out, specials


class Walk:
    """Times one engine: `setup` once, then per schema `compile` and a masked walk."""

    def __init__(self, tok: tokenizers.Tokenizer, eos: int):
        self.tok, self.eos, self.vocab = tok, eos, tok.get_vocab_size(with_added_tokens=True)

    def llguidance(self) -> tuple[Callable[[dict], Any], Callable[[Any, list[int]], list[float]]]:
        import llguidance
        import llguidance.numpy as lln

        lltok = llguidance.LLTokenizer(self.tok.to_str(), eos_token=self.eos)
        mask = lln.allocate_token_bitmask(1, self.vocab)

        def compile_(schema: dict) -> Any:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            return llguidance.LLMatcher(lltok, grammar)  # the grammar compiles here

        def walk(matcher: Any, ids: list[int]) -> list[float]:
            return _walk(ids, lambda: lln.fill_next_token_bitmask(matcher, mask),
                         matcher.consume_token)
        return compile_, walk

    def outlines_core(self):
        import outlines_core as oc

        raw, specials = token_bytes(self.tok)
        entries: dict[bytes, list[int]] = {}
        for i, b in enumerate(raw):
            if i not in specials:
                entries.setdefault(b, []).append(i)
        vocabulary = oc.Vocabulary(self.eos, entries)
        mask = np.zeros((self.vocab + 31) // 32, dtype=np.int32)

        def compile_(schema: dict) -> Any:
            regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
            return oc.Index(regex, vocabulary)

        def walk(index: Any, ids: list[int]) -> list[float]:
            guide = oc.Guide(index)
            return _walk(ids, lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4),
                         guide.advance)
        return compile_, walk

    def xgrammar(self):
        import xgrammar as xgr

        raw, _ = token_bytes(self.tok)
        info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, stop_token_ids=[self.eos])
        compiler = xgr.GrammarCompiler(info)
        mask = xgr.allocate_token_bitmask(1, self.vocab)

        def compile_(schema: dict) -> Any:
            return compiler.compile_json_schema(schema)

        def walk(compiled: Any, ids: list[int]) -> list[float]:
            matcher = xgr.GrammarMatcher(compiled)
            return _walk(ids, lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token)
        return compile_, walk


def _walk(ids: list[int], fill: Callable[[], Any], consume: Callable[[int], Any]) -> list[float]:
    """Seconds per mask along `ids` (the final one, where only EOS is left, included)."""
    times = []
    for token in [*ids, None]:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        if token is not None and consume(token) is False:
            raise RuntimeError(f"the engine refused token {token}")
    return times


def imports_torch(engine: str) -> str:
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK.format(engine)],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "not installed"


def measure(engine: str, walk: Walk, cases: list[tuple[dict, list[int]]]) -> dict[str, Any]:
    start = time.perf_counter()
    compile_, run = getattr(walk, engine)()
    setup_s = time.perf_counter() - start
    compile_ms, mask_us = [], []
    for schema, ids in cases:
        start = time.perf_counter()
        compiled = compile_(schema)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        mask_us += [t * 1e6 for t in run(compiled, ids)]
    return {"engine": engine, "setup_s": round(setup_s, 3),
            "compile_ms_mean": round(statistics.mean(compile_ms), 2),
            "compile_ms_max": round(max(compile_ms), 2),
            "mask_us_mean": round(statistics.mean(mask_us), 1),
            "mask_us_p50": round(statistics.median(mask_us), 1),
            "mask_us_p99": round(float(np.percentile(mask_us, 99)), 1),
            "masks": len(mask_us), "imports": imports_torch(engine)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args()
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(args.artifact / manifest["tokenizer"]["file"]))
    eos = manifest["tokenizer"]["eos_token_id"]
    rng = random.Random(args.seed)
    cases = [(s, tok.encode(json.dumps(random_instance(s, rng)), add_special_tokens=False).ids)
             for s in schemas(args.seed, args.schemas)]
    walk = Walk(tok, eos)
    rows = []
    for engine in args.engines.split(","):
        try:
            rows.append(measure(engine, walk, cases))
        except ImportError as exc:
            rows.append({"engine": engine, "error": str(exc)})
    print(f"vocabulary {walk.vocab} tokens, {len(cases)} schemas, "
          f"{sum(len(ids) + 1 for _, ids in cases)} masks per engine")
    print(f"{'engine':14} {'setup s':>8} {'compile ms':>11} {'mask us mean':>13} {'p50':>7} "
          f"{'p99':>8}  imports")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:14} {r['error']}")
            continue
        print(f"{r['engine']:14} {r['setup_s']:8.3f} {r['compile_ms_mean']:11.2f} "
              f"{r['mask_us_mean']:13.1f} {r['mask_us_p50']:7.1f} {r['mask_us_p99']:8.1f}  "
              f"{r['imports']}")
    write_json(RESULTS_DIR / "grammar_engines.json", {"machine": machine_info(
        ("llguidance", "outlines_core", "xgrammar")), "vocab": walk.vocab, "rows": rows})


if __name__ == "__main__":
    main()
