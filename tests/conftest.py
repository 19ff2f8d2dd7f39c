import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="lazytrain: no CUDA device")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
