import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="lazytrain: no CUDA device")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def k():
    """The optimizer's C++ host kernels (built on first use); tests needing them skip without a compiler."""
    from lazytrain.optim import kernels
    lib = kernels.cpu_kernels()
    if lib is None:
        pytest.skip(f"C++ kernels unavailable: {kernels.build_error()}")
    return lib
