"""Test setup: Triton's interpreter on machines without a GPU, fresh seeds, the cuda marker."""

import os

import pytest
import torch

# Triton kernels are decorated at import time, so the interpreter must be chosen
# before attnres_kernels.triton is imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_rounds_bf16_to_nearest_even():
    """Triton's interpreter converts fp32 to bf16 by dropping the low 16 bits (toward zero); a GPU rounds to
    nearest even (``cvt.rn.bf16.f32``), as PyTorch does. Toward zero every bf16 output is off by up to a whole
    ulp, always in the same direction, and a kernel's bf16 error no longer compares with a same-precision
    PyTorch run's (for one seed the Triton attention backward's bf16 dq came out 4.5 % off in one row, 7x
    PyTorch's error). The tests check the kernels as a GPU runs them: the interpreter's fp32 -> bf16 casts go
    through PyTorch's rounding."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl  # an AttributeError here means Triton's interpreter changed: update this patch

    def cast_rounding_to_nearest_even(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_rounding_to_nearest_even  # (its create_fp_trunc, a store's implicit cast, calls it)


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        _interpreter_rounds_bf16_to_nearest_even()

# Under pytest-xdist each worker gets its share of the cores, and so do the processes its tests start
# (OMP_NUM_THREADS). PyTorch's OpenMP threads spin while they wait for work: with two workers of two
# threads each on two cores, a spinning thread held the core another worker needed (the demo test took
# 5 s alone and 31-72 s beside another worker). Tests about thread counts set their own.
_xdist_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _xdist_workers > 1:
    _threads = max(1, len(os.sched_getaffinity(0)) // _xdist_workers)
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


# Modules with the suite's longest tests (tens of seconds each: process groups, torch.compile, a benchmark's
# dry run), run first: pytest-xdist hands out the last tests one by one, and one of these at the end kept one
# worker busy while the other had nothing left.
LONGEST_FIRST = (
    "test_nn_compile.py",
    "test_gpu_benchmark_script.py",
    "test_hf_inkling2.py",
    "test_train.py",
    "test_tensor_parallel.py",
    "test_distributed.py",
    "test_dcp.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)
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
