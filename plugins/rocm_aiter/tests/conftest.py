import pytest
import torch


@pytest.fixture
def gen(rng_seed: int) -> torch.Generator:
    """Random inputs from the test's printed seed (JACKFIELD_TEST_SEED reproduces a run)."""
    return torch.Generator().manual_seed(rng_seed)
