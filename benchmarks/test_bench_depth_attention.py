"""pytest-benchmark suite: ``pytest --benchmark benchmarks/`` (skipped without ``--benchmark``).

Depth read: the C++ op against the eager reference, ``torch.compile`` of the
reference and a tensor copy of the same bytes, in fp32 and bf16. Every
benchmark records the bytes it moves and its GB/s (median) in ``extra_info``;
pytest-benchmark's table gives the median and spread (IQR, min, max) of each.
Compare ratios within one run (the machines are shared).

Outputs: the C++ op reuses the buffers of freed outputs (``reused``, what a
training loop sees after its first step); ``fresh`` empties that cache before
every round, so each output is a new allocation that page-faults on first touch.
The copy references are a ``copy_`` into a reused buffer and a ``clone`` (fresh).
The full sweep with a markdown report is ``python benchmarks/sweep.py``.
"""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels.demo import CharTokenizer, build_model, load_pairs, make_batch

from common import (
    empty_output_cache,
    forward_backward,
    fused_read,
    make_read_inputs,
    read_bytes,
    reference_read,
    tensor_clone,
    tensor_copy,
)

pytestmark = pytest.mark.benchmark_suite

SHAPES = [(3, 4096, 256), (9, 8192, 1024), (17, 4096, 1024)]  # (N sources, rows, D)
IDS = [f"N{n}-M{m}-D{d}" for n, m, d in SHAPES]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDS = 10
# The references allocate through PyTorch's default allocator ("default": a fresh
# mapping for every large output).
IMPLS = [("cpu", "reused"), ("cpu", "fresh"), ("reference", "default"), ("compiled_reference", "default")]


def _record(benchmark, nbytes=None):
    stats = benchmark.stats.stats
    benchmark.extra_info["median/min"] = stats.median / stats.min
    if nbytes is not None:
        benchmark.extra_info["bytes"] = nbytes
        benchmark.extra_info["GB/s (median)"] = nbytes / stats.median / 1e9


def _run(benchmark, fn, outputs="reused"):
    """pytest-benchmark's calibrated loop; for ``fresh`` outputs the output cache is
    emptied (untimed) before every round instead."""
    if outputs == "fresh":
        benchmark.pedantic(fn, setup=empty_output_cache, rounds=ROUNDS, warmup_rounds=1)
    else:
        benchmark(fn)


def _impl(name):
    if name == "reference":
        return reference_read
    if name == "compiled_reference":
        return torch.compile(reference_read)
    return fused_read(name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,rows,dim", SHAPES, ids=IDS)
@pytest.mark.parametrize("outputs", ["reused", "fresh"])
def test_tensor_copy(benchmark, outputs, n, rows, dim, dtype):
    """The bandwidth reference: as many bytes as a forward moves (``copy_`` into a
    reused buffer, or ``clone`` into a fresh one)."""
    copy, nbytes = (tensor_copy if outputs == "reused" else tensor_clone)(rows, dim, DTYPES[dtype], (n + 2) // 2)
    with torch.no_grad():
        benchmark(copy)
    _record(benchmark, nbytes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,rows,dim", SHAPES, ids=IDS)
@pytest.mark.parametrize("impl,outputs", IMPLS)
def test_forward(benchmark, impl, outputs, n, rows, dim, dtype):
    sources, query, norm_weight = make_read_inputs(n, rows, dim, DTYPES[dtype], requires_grad=False)
    read = _impl(impl)
    with torch.no_grad():
        read(query, sources, norm_weight)  # compile outside the timing
        _run(benchmark, lambda: read(query, sources, norm_weight), outputs)
    _record(benchmark, read_bytes(n, rows, dim, DTYPES[dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,rows,dim", SHAPES, ids=IDS)
@pytest.mark.parametrize("impl,outputs", IMPLS)
def test_forward_backward(benchmark, impl, outputs, n, rows, dim, dtype):
    sources, query, norm_weight = make_read_inputs(n, rows, dim, DTYPES[dtype], requires_grad=True)
    read = _impl(impl)
    grad_out = torch.randn(rows, dim).to(DTYPES[dtype])
    forward_backward(read, sources, query, norm_weight, grad_out)  # compile outside the timing
    _run(benchmark, lambda: forward_backward(read, sources, query, norm_weight, grad_out), outputs)
    _record(benchmark)


@pytest.mark.parametrize("model", ["Standard", "Full", "Block"])
def test_demo_train_step(benchmark, model):
    """One AdamW step of the demo model (d=128, 6 layers, 4 heads, batch 10) on the fused kernels."""
    pairs = load_pairs()
    tok = CharTokenizer([t for pair in pairs for t in pair])

    class Args:
        d_model, layers, heads, blocks, backend = 128, 6, 4, 3, "auto"

    net = build_model(model, len(tok.itos), Args)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, fused=True)
    x, y = make_batch(pairs[:10], tok)

    def step():
        logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    benchmark(step)
    benchmark.extra_info["depth-attention backend"] = ak.ops.resolve_backend("auto", torch.device("cpu"), 128)
