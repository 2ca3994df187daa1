"""The model's own samples: one sampler for calibration and the quality probe."""

from __future__ import annotations

import pytest
import torch

from llmopt.compiler import model_samples
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.model_samples import SampleMemo, memoized_samples, sample
from llmopt.compiler.reference import KVCache, ReferenceModel


@pytest.fixture(scope="module")
def ir(tiny_checkpoints):
    return load_checkpoint(str(tiny_checkpoints["llama"]))


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(SampleMemo, "key", None)
    monkeypatch.setattr(SampleMemo, "samples", None)
    monkeypatch.setattr(SampleMemo, "directory", None)


def growing_cache_samples(ir, count: int, seq_len: int, seed: int) -> list[list[int]]:
    """The plain loop: a cache that grows by concatenation, every token drawn in turn."""
    model, cache = ReferenceModel(ir, seq_len), KVCache()
    generator = torch.Generator().manual_seed(seed)
    columns = [torch.full((count, 1), ir.arch.bos_token_id, dtype=torch.int64)]
    logits = model.forward(columns[0], cache, all_logits=False)
    for _ in range(seq_len - 1):
        logits[:, ir.arch.eos_token_ids] = -torch.inf
        columns.append(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        logits = model.forward(columns[-1], cache, all_logits=False)
    return torch.cat(columns, 1).tolist()


def test_the_preallocated_cache_samples_what_the_growing_cache_samples(ir):
    assert sample(ir, 3, 24, seed=5).tolist() == growing_cache_samples(ir, 3, 24, seed=5)


def test_batches_of_samples_come_from_one_generator(ir, monkeypatch):
    monkeypatch.setattr(model_samples, "SAMPLE_BATCH", 2)
    drawn = sample(ir, 5, 12, seed=5)
    assert drawn.shape == (5, 12)
    assert drawn[:2].tolist() == growing_cache_samples(ir, 2, 12, seed=5)
    assert len({tuple(row) for row in drawn.tolist()}) == 5


def test_a_compile_draws_its_samples_once(ir, monkeypatch):
    calls = []
    monkeypatch.setattr(model_samples, "sample",
                        lambda *a, **k: calls.append(a[1]) or sample(*a, **k))
    first = memoized_samples(ir, 3, 8, seed=1)
    assert torch.equal(memoized_samples(ir, 2, 8, seed=1), first[:2])
    memoized_samples(ir, 2, 8, seed=2)  # another seed: other sequences
    changed = ir.copy()
    changed.weights["final_norm"] = changed.weights["final_norm"] * 2
    memoized_samples(changed, 2, 8, seed=2)
    assert calls == [3, 2, 2]


def test_a_set_kept_on_disk_is_read_back_not_drawn_again(ir, tmp_path, monkeypatch):
    SampleMemo.directory = tmp_path
    first = memoized_samples(ir, 3, 8, seed=1)
    assert len(list(tmp_path.glob("samples-*-3x8-1.pt"))) == 1
    SampleMemo.key = SampleMemo.samples = None  # a new process
    monkeypatch.setattr(model_samples, "sample", lambda *a, **k: pytest.fail("drawn again"))
    assert torch.equal(memoized_samples(ir, 3, 8, seed=1), first)
