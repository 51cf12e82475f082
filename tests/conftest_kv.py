"""Fixtures for the KV tests (imported by tests/test_kv_*.py)."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run on one thread: on a shared 2-core box, intra-op thread barriers under load make the many small tensor
    ops of the tile codecs several times slower than a single thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
