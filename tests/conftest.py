"""Test setup: Triton's interpreter on machines without a GPU, fresh seeds, the cuda marker."""

import os

import torch

# Triton kernels are decorated at import time, so the interpreter must be chosen
# before attnres_kernels.triton is imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    """A fresh random seed per test and run, printed so that a failure can be replayed
    (``ATTNRES_TEST_SEED=<seed> pytest ...`` runs with that seed)."""
    seed = int(os.environ.get("ATTNRES_TEST_SEED") or int.from_bytes(os.urandom(4), "little") >> 1)
    torch.manual_seed(seed)
    print(f"torch seed: {seed}")  # shown with the captured output of a failing test
    yield
