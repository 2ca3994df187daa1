"""Distillation of a draft towards the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import draft
from llmopt.passes.draft import model as dm
from llmopt.passes.draft.distill import DistillSettings, distill, held_out_kl

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_tiny_draft_distillation_lowers_the_kl(target, word_text):
    windows = draft.text_windows(target, word_text, 32)[:40]
    shape = dm.TinyShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64)
    basis = dm.residual_basis(target, draft._residual_states(target, windows[-2:]), 32)
    tiny = dm.sliced_tiny(target, shape, basis, [0])
    assert tiny.arch.hidden_size == 32 and tiny.arch.num_layers == 1
    trained, report = distill(tiny, target, windows, None,
                              DistillSettings(steps=30, lr=3e-3, batch_size=4, trainable=("*",)),
                              log=lambda _: None)
    assert report["held_out_kl_after"] < 0.8 * report["held_out_kl_before"]
    curve = report["loss_curve"]
    assert np.mean(curve[-3:]) < np.mean(curve[:3])
    teacher, student = ReferenceModel(target, 32), ReferenceModel(trained, 32)
    assert held_out_kl(teacher, student, windows[:4], None) == pytest.approx(
        report["held_out_kl_after"], abs=1e-4)


def test_teacher_logits_on_a_trimmed_head(target):
    from llmopt.passes.draft.distill import teacher_logits

    ids, rows = torch.tensor([list(range(3, 30))]), torch.tensor([2, 9, 40, 200])
    teacher = ReferenceModel(target)
    torch.testing.assert_close(teacher_logits(teacher, ids, rows),
                               teacher.forward(ids)[..., rows])
