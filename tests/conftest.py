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


def _interpreter_patches_the_language_once_per_launch():
    """Triton's interpreter swaps ``triton.language``'s builtins for interpreted ones when a kernel launches
    (restoring them when it returns), and again on every call of a ``@triton.jit`` helper inside the kernel
    (``inspect.getmembers`` over three modules, about 0.5 ms a call, kept patched until the launch restores
    them): a third of an interpreted test's time. Inside a launch that already patched the modules a helper
    sees, the helper's call skips the repeat. A helper reaching a module the launch did not patch is patched
    as before (Triton's own helpers such as ``tl.sum`` see ``triton.language.core``), and left patched until
    the launch returns, as Triton leaves it; a builtin left unpatched would raise, not compute something else."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang  # an AttributeError here means Triton's interpreter changed
    launch = interpreter.GridExecutor.__call__
    patched = []  # the language modules patched since the running launch began (empty: no launch running)

    def language_modules(fn):
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_lang_unless_patched(fn):
        if patched and language_modules(fn) <= patched[0]:
            return interpreter._LangPatchScope()  # nothing changed, nothing to restore
        scope = patch_lang(fn)
        if patched:
            patched[0] |= language_modules(fn)
        else:  # the launch itself (GridExecutor.__call__ patches before it runs the grid)
            patched.append(language_modules(fn))
        return scope

    def launch_tracking_its_patch(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = patch_lang_unless_patched
    interpreter.GridExecutor.__call__ = launch_tracking_its_patch


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        _interpreter_rounds_bf16_to_nearest_even()
        _interpreter_patches_the_language_once_per_launch()

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


@pytest.fixture
def cuda_emulation(monkeypatch):
    """The CUDA backend on CPU tensors: its kernels run under the SIMT harness (``ATTNRES_CUDA_EMULATE=1``),
    with the launches of earlier tests dropped from the launch log. A module of such tests says
    ``pytestmark = pytest.mark.usefixtures("cuda_emulation")``."""
    from attnres_kernels.cuda import emulation

    monkeypatch.setenv(emulation.ENV, "1")
    reason = emulation.load()
    assert reason is None, reason
    emulation.launch_log()  # drop the launches of earlier tests
    yield


@pytest.fixture(autouse=True)
def _seed(request):
    """A fresh random seed per test and run, printed so that a failure can be replayed
    (``ATTNRES_TEST_SEED=<seed> pytest ...`` runs with that seed)."""
    seed = int(os.environ.get("ATTNRES_TEST_SEED") or int.from_bytes(os.urandom(4), "little") >> 1)
    torch.manual_seed(seed)
    print(f"torch seed: {seed}")  # shown with the captured output of a failing test
    yield
