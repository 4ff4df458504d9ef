import pytest
import torch

torch.manual_seed(0)


@pytest.fixture
def kit():
    from unimp_torch.testing import TorchKit

    return TorchKit()
