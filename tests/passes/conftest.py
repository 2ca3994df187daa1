"""Fixtures shared by the pass tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def single_torch_thread():
    """Pin torch to one intra-op thread for a module: the passes' small ops run faster so
    on the shared cores, and results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
