"""Helpers shared by the pytest-benchmark suite and the sweep script."""

from __future__ import annotations

import statistics
import time

import torch

import attnres_kernels as ak
from attnres_kernels import reference


def median_seconds(fn, min_runs: int = 5, min_seconds: float = 0.5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over at least ``min_runs`` runs and ``min_seconds``."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bytes(n: int, rows: int, dim: int, dtype: torch.dtype) -> int:
    """The floor of a forward depth read: N source rows read once, one output row written."""
    return (n + 1) * rows * dim * torch.tensor([], dtype=dtype).element_size()


def make_read_inputs(n: int, rows: int, dim: int, dtype: torch.dtype, requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(rows, dim, generator=gen).to(dtype).requires_grad_(requires_grad) for _ in range(n)]
    query = (0.05 * torch.randn(dim, generator=gen)).requires_grad_(requires_grad)
    norm_weight = (1 + 0.1 * torch.randn(dim, generator=gen)).requires_grad_(requires_grad)
    return sources, query, norm_weight


def reference_read(query, sources, norm_weight):
    """The eager reference: stack + RMSNorm + softmax + einsum."""
    return reference.depth_attention(query, sources, norm_weight)


def fused_read(backend: str):
    def read(query, sources, norm_weight):
        return ak.depth_attention(query, sources, norm_weight, backend=backend)

    return read


def forward_backward(read, sources, query, norm_weight, grad_out):
    """One forward and backward; gradients are returned, not accumulated."""
    out = read(query, sources, norm_weight)
    return torch.autograd.grad(out, [*sources, query, norm_weight], grad_out)


def tensor_copy(rows: int, dim: int, dtype: torch.dtype, n: int):
    """``copy_`` of ``n`` [rows, dim] tensors' worth into a preallocated tensor, and the bytes it moves."""
    src = torch.randn(n * rows, dim).to(dtype)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src), 2 * src.numel() * src.element_size()


def saved_activation_bytes(fn) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward while running ``fn``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
