"""pytest-benchmark suite: ``pytest --benchmark benchmarks/`` (skipped without ``--benchmark``).

Each benchmark records the bytes it moves in ``extra_info`` so GB/s can be read
off the report; compare ratios within one run (the machines are shared).
The full sweep with a markdown report is ``python benchmarks/sweep.py``.
"""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels.demo import CharTokenizer, build_model, load_pairs, make_batch

from common import (
    forward_backward,
    fused_read,
    make_read_inputs,
    read_bytes,
    reference_read,
    tensor_copy,
)

pytestmark = pytest.mark.benchmark_suite

SHAPES = [(3, 4096, 256), (9, 8192, 1024), (17, 4096, 1024)]  # (N sources, rows, D)
IDS = [f"N{n}-M{m}-D{d}" for n, m, d in SHAPES]


def _gbps(benchmark, nbytes):
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s (median)"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("n,rows,dim", SHAPES, ids=IDS)
def test_tensor_copy(benchmark, n, rows, dim):
    copy, nbytes = tensor_copy(rows, dim, torch.float32, n)
    benchmark(copy)
    _gbps(benchmark, nbytes)


@pytest.mark.parametrize("n,rows,dim", SHAPES, ids=IDS)
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_forward(benchmark, impl, n, rows, dim):
    sources, query, norm_weight = make_read_inputs(n, rows, dim, torch.float32, requires_grad=False)
    read = reference_read if impl == "reference" else fused_read(impl)
    with torch.no_grad():
        benchmark(read, query, sources, norm_weight)
    _gbps(benchmark, read_bytes(n, rows, dim, torch.float32))


@pytest.mark.parametrize("n,rows,dim", SHAPES, ids=IDS)
@pytest.mark.parametrize("impl", ["reference", "compiled_reference", "cpu"])
def test_forward_backward(benchmark, impl, n, rows, dim):
    sources, query, norm_weight = make_read_inputs(n, rows, dim, torch.float32, requires_grad=True)
    read = {"reference": reference_read, "compiled_reference": torch.compile(reference_read), "cpu": fused_read("cpu")}[
        impl
    ]
    grad_out = torch.randn(rows, dim)
    forward_backward(read, sources, query, norm_weight, grad_out)  # compile outside the timing
    benchmark(forward_backward, read, sources, query, norm_weight, grad_out)


@pytest.mark.parametrize("model", ["Standard", "Full", "Block"])
def test_demo_train_step(benchmark, model):
    """One AdamW step of the demo model (d=128, 6 layers, 4 heads, batch 10) on the fused kernels."""
    pairs = load_pairs()
    tok = CharTokenizer([t for pair in pairs for t in pair])

    class Args:
        d_model, layers, heads, blocks, backend = 128, 6, 4, 3, "auto"

    net = build_model(model, len(tok.itos), Args)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    x, y = make_batch(pairs[:10], tok)

    def step():
        logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    benchmark(step)
    benchmark.extra_info["depth-attention backend"] = ak.ops.resolve_backend("auto", torch.device("cpu"), 128)
