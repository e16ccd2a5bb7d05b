"""Fixtures shared by the tests (the repository's conftest.py handles GPU skips and nbval)."""
import numpy as np
import pytest


@pytest.fixture
def rng():
    """Fresh inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)
