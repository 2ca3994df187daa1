"""Draft building per kind: vocabulary mapping, truncation, head trimming."""

from __future__ import annotations

import pytest
import torch
from draft_helpers import (
    SUBSET_TOKENS,
    TARGET_TOKENS,
    save_draft,
    truncated_logits,
)

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes.draft import model as dm

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_identical_vocabulary_passes_unchanged(target, tmp_path):
    same = load_checkpoint(str(save_draft(tmp_path / "same", TARGET_TOKENS, 256)))
    mapped, token_map = dm.map_to_target(same, target)
    assert token_map is None and mapped is same


def test_subset_vocabulary_is_mapped(target, subset_dir):
    original = load_checkpoint(str(subset_dir))
    mapped, token_map = dm.map_to_target(original, target)
    target_id = {t: i for i, t in enumerate(TARGET_TOKENS)}
    assert token_map.tolist() == [target_id[t] for t in SUBSET_TOKENS]  # padding rows dropped
    assert mapped.arch.vocab_size == len(SUBSET_TOKENS)
    assert mapped.weights["embed_tokens"].shape[0] == target.arch.vocab_size
    # The same text in each model's own ids: the mapped draft's logits are the original's
    # rows for the tokens it has.
    text = [t for t in SUBSET_TOKENS[3:] if not t.startswith("w")][:30] + ["w3", "w7"]
    draft_ids = torch.tensor([[SUBSET_TOKENS.index(t) for t in text]])
    target_ids = torch.tensor([[target_id[t] for t in text]])
    expected = ReferenceModel(original).forward(draft_ids)[..., : len(SUBSET_TOKENS)]
    torch.testing.assert_close(ReferenceModel(mapped).forward(target_ids), expected)
    # A target token the draft lacks reads the draft's unk row (<pad>, id 0).
    assert torch.equal(mapped.weights["embed_tokens"][target_id["w100"]],
                       original.weights["embed_tokens"][0])


def test_mismatched_vocabulary_is_refused(target, tmp_path):
    tokens = TARGET_TOKENS[:40] + ["zzz"] + TARGET_TOKENS[41:]
    other = load_checkpoint(str(save_draft(tmp_path / "other", tokens, 256)))
    with pytest.raises(dm.TokenizerMismatchError,
                       match=r"1 of 256 .*40 'zzz'.*first differing token id 40: target 'E', "
                             r"draft 'zzz'"):
        dm.map_to_target(other, target)


def test_self_draft_is_the_truncated_target(target):
    ids = torch.tensor([list(range(3, 40))])
    got = ReferenceModel(dm.truncated(target, 2)).forward(ids)
    torch.testing.assert_close(got, truncated_logits(target, ids, 2))
    with pytest.raises(ValueError, match="keeps 1..2"):
        dm.truncated(target, 3)


def test_head_trimming_keeps_the_frequent_rows(target):
    ids = torch.tensor([[5, 5, 5, 9, 9, 200, 7]])
    keep = dm.frequent_tokens(ids, 4, always=(2,), vocab_size=256)
    assert keep.tolist() == [2, 5, 7, 9]  # eos always; then 5, 9, and 7 over 200 (lower id)
    trimmed, token_map = dm.trim_head(dm.truncated(target, 1), None, keep)
    assert token_map.tolist() == [2, 5, 7, 9] and trimmed.arch.vocab_size == 4
    probe = torch.tensor([list(range(3, 20))])
    full = ReferenceModel(dm.truncated(target, 1)).forward(probe)
    torch.testing.assert_close(ReferenceModel(trimmed).forward(probe), full[..., keep])
