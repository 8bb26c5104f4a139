"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms, as polyrl's CPU runs set them (polyrl.core.distributed.process)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
