"""Shared pytest configuration: markers, seeding, device skips."""

from __future__ import annotations

import os

import pytest

# Gradio must never phone home from tests.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error reported elsewhere
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything():
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    # A test (or the code it calls) that switches autograd off for the process breaks every later test that
    # trains: fail the test that leaked it, and restore the switch for the rest.
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("autograd was left disabled (torch.set_grad_enabled(False) without restoring it)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tests on tiny tensors: on shared cores, contending OpenMP teams
    are far slower than one thread. Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
