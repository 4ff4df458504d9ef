import pytest
import torch

torch.manual_seed(0)


@pytest.fixture
def kit():
    from unimp_ipex.testing import IpexKit

    return IpexKit()
