import os

import pytest
import torch
from hypothesis import settings

# Unit tests are small; one thread keeps two xdist workers from fighting.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def gen():
    """A seeded CPU generator: tests draw their numbers from it."""
    return torch.Generator().manual_seed(1234)
