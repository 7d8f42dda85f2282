"""pytest-benchmark suite of fused attention on CPU: ``pytest --benchmark benchmarks/test_bench_attention.py``.

Forward and forward+backward of the C++ op against PyTorch's
``scaled_dot_product_attention`` (its CPU flash kernel), the eager reference and
``torch.compile`` of the reference. Compare ratios within one run (the machines
are shared); the full sweep with a markdown report is
``python benchmarks/attention_sweep.py``.
"""

import pytest
import torch
import torch.nn.functional as F

import attnres_kernels as ak
from attnres_kernels import reference

pytestmark = pytest.mark.benchmark_suite

SHAPES = [(512, 64), (1024, 64), (1024, 128)]  # (T, Dh) with B = 2, H = 8
IDS = [f"T{t}-D{dh}" for t, dh in SHAPES]
IMPLS = ["cpu", "sdpa", "reference", "compiled_reference"]


def _impl(name, causal):
    if name == "cpu":
        return lambda q, k, v: ak.attention(q, k, v, causal=causal, backend="cpu")
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    fn = lambda q, k, v: reference.attention(q, k, v, causal=causal)
    return torch.compile(fn) if name == "compiled_reference" else fn


def _inputs(t, dh, dtype, requires_grad):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 8, t, dh, generator=gen).to(dtype).requires_grad_(requires_grad) for _ in range(3)]


def _flops(benchmark, t, dh, causal, passes):
    """Matmul FLOPs (QKᵀ and PV; the backward counts 2.5 forwards) and GFLOP/s at the median."""
    flops = passes * 4 * 2 * 8 * t * t * dh * (0.5 if causal else 1.0)
    benchmark.extra_info["GFLOP/s (median)"] = flops / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("t,dh", SHAPES, ids=IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_forward(benchmark, impl, dtype, causal, t, dh):
    fn = _impl(impl, causal)
    q, k, v = _inputs(t, dh, dtype, requires_grad=False)
    fn(q, k, v)  # compile outside the timing
    benchmark(fn, q, k, v)
    _flops(benchmark, t, dh, causal, 1.0)


@pytest.mark.parametrize("t,dh", SHAPES, ids=IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_forward_backward(benchmark, impl, dtype, causal, t, dh):
    fn = _impl(impl, causal)
    q, k, v = _inputs(t, dh, dtype, requires_grad=True)
    grad_out = torch.randn_like(q)

    def step():
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)

    step()  # compile outside the timing
    benchmark(step)
    _flops(benchmark, t, dh, causal, 3.5)
