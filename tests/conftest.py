"""Test setup: Triton's interpreter on machines without a GPU, fresh seeds, the cuda marker."""

import os

import pytest
import torch

# Triton kernels are decorated at import time, so the interpreter must be chosen
# before attnres_kernels.triton is imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker gets its share of the cores, and so do the processes its tests start
# (OMP_NUM_THREADS). PyTorch's OpenMP threads spin while they wait for work: with two workers of two
# threads each on two cores, a spinning thread held the core another worker needed (the demo test took
# 5 s alone and 31-72 s beside another worker). Tests about thread counts set their own.
_xdist_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _xdist_workers > 1:
    _threads = max(1, len(os.sched_getaffinity(0)) // _xdist_workers)
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


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
