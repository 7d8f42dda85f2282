"""pytest-benchmark: the fused Block step vs the unfused sequence (``pytest --benchmark benchmarks/``).

The fused step (``ak.block_step``) against what it replaces: ``partial + update``
followed by ``depth_attention_merge`` with the fused output norm (the C++ merge
op), the eager reference, and ``torch.compile`` of the reference. Each records
the bytes it moves (``extra_info``) so GB/s can be compared with a tensor copy
measured in the same run. Outputs are freshly allocated on every call, as in a
model (their page faults are part of the time). Compare ratios within one run.
"""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference

pytestmark = pytest.mark.benchmark_suite

# (rows, D): a large step (memory-bound), and the demo's step (rows = batch 10 x ~20 tokens, d = 128:
# fixed per-call costs dominate).
SHAPES = [(8192, 1024), (200, 128)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def row_bytes(dim: int, dtype: torch.dtype, impl: str, backward: bool) -> int:
    """Bytes one row moves to and from memory (outputs written once, inputs read once).

    Forward: the fused step reads partial, update, h_a and writes new_partial, out
    (5 rows); unfused, the add moves 3 rows and the merge reads the sum and h_a and
    writes out (6 rows). Backward: fused, read grad_new_partial, grad_out, new_partial,
    h_a and write the total grad and grad h_a (6 rows); unfused, the merge's backward
    moves 5 rows and autograd's sum of the two grads of new_partial 3 more (8 rows).
    Each adds 16 bytes of per-row fp32 scalars (lse_a, lse, logit, rinv)."""
    e = torch.tensor([], dtype=dtype).element_size()
    fused = impl == "cpu"
    rows = (5 if fused else 6) + ((6 if fused else 8) if backward else 0)
    return rows * dim * e + 16 * (2 if backward else 1)


def make_inputs(rows: int, dim: int, dtype: torch.dtype, requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen)).to(dtype)
    partial, update, h_a = rand(rows, dim), rand(rows, dim), rand(rows, dim)
    lse_a = torch.randn(rows, generator=gen)
    query = 0.05 * torch.randn(dim, generator=gen)
    norm_weight, out_norm_weight = (1 + 0.1 * torch.randn(dim, generator=gen) for _ in range(2))
    tensors = [partial, update, query, h_a, lse_a, norm_weight, out_norm_weight]
    return [t.requires_grad_(requires_grad) for t in tensors]


def fused_step(partial, update, query, h_a, lse_a, norm_weight, out_norm_weight):
    return ak.block_step(
        partial, update, query, h_a, lse_a, norm_weight, out_norm_weight=out_norm_weight, backend="cpu"
    )


def unfused_step(partial, update, query, h_a, lse_a, norm_weight, out_norm_weight):
    new = partial + update
    out = ak.depth_attention_merge(
        query, h_a, lse_a, [new], norm_weight, out_norm_weight=out_norm_weight, backend="cpu"
    )
    return new, out


def reference_step(partial, update, query, h_a, lse_a, norm_weight, out_norm_weight):
    return reference.block_step(partial, update, query, h_a, lse_a, norm_weight, out_norm_weight=out_norm_weight)


IMPLS = {"cpu": fused_step, "unfused_cpu": unfused_step, "reference": reference_step}


def _step(impl: str):
    return torch.compile(reference_step) if impl == "compiled_reference" else IMPLS[impl]


def _record(benchmark, nbytes):
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s (median)"] = nbytes / benchmark.stats.stats.median / 1e9


def _ids(shapes):
    return [f"M{m}-D{d}" for m, d in shapes]


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows,dim", SHAPES, ids=_ids(SHAPES))
def test_tensor_copy(benchmark, rows, dim, dtype):
    """Bandwidth reference: ``copy_`` of 5 rows' worth per row into a reused buffer."""
    src = torch.randn(5 * rows, dim).to(DTYPES[dtype])
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    _record(benchmark, 2 * src.numel() * src.element_size())


@pytest.mark.parametrize("impl", ["cpu", "unfused_cpu", "reference", "compiled_reference"])
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows,dim", SHAPES, ids=_ids(SHAPES))
def test_forward(benchmark, impl, rows, dim, dtype):
    inputs = make_inputs(rows, dim, DTYPES[dtype], requires_grad=False)
    step = _step(impl)
    with torch.no_grad():
        step(*inputs)  # compile outside the timing
        benchmark(step, *inputs)
    _record(benchmark, rows * row_bytes(dim, DTYPES[dtype], impl, backward=False))


@pytest.mark.parametrize("impl", ["cpu", "unfused_cpu", "reference", "compiled_reference"])
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows,dim", SHAPES, ids=_ids(SHAPES))
def test_forward_backward(benchmark, impl, rows, dim, dtype):
    """One step and the gradients of every input, given gradients of new_partial (the
    next step's) and of out (the sublayer's)."""
    inputs = make_inputs(rows, dim, DTYPES[dtype], requires_grad=True)
    grad_new, grad_out = torch.randn(rows, dim).to(DTYPES[dtype]), torch.randn(rows, dim).to(DTYPES[dtype])
    step = _step(impl)

    def forward_backward():
        new, out = step(*inputs)
        return torch.autograd.grad([new, out], inputs, [grad_new, grad_out])

    forward_backward()  # compile outside the timing
    benchmark(forward_backward)
    _record(benchmark, rows * row_bytes(dim, DTYPES[dtype], impl, backward=True))
