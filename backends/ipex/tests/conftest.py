import pytest
import torch

torch.manual_seed(0)


@pytest.fixture
def kit():
    from unimp_ipex.kit import IpexKit

    return IpexKit()
