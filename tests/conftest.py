import pytest
import torch

from engine.models import load_pair


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads the embedded default pair (SmolLM2-135M); still runs in CI")


@pytest.fixture(scope="session")
def tiny_pair():
    return load_pair("tiny")


@pytest.fixture(scope="session")
def default_pair():
    return load_pair("default")


@pytest.fixture(params=["transformers", "fast"])
def backend(request):
    """Engine tests run on both model backends: the transformers one and the fast static-cache one."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
