"""The host-cost section: where the host's time goes in one depth read on each fused backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import attnres_kernels as ak
from attnres_kernels._validation import ReadOptions
from attnres_kernels.ops import _dispatch
from attnres_kernels.ops.depth_attention import read_unchecked

from .environment import EPS, Env
from .reads import ReadCase, make_inputs


@dataclass
class HostRow:
    """The host's cost of one kind of call: best and median µs per call over rounds of calls issued
    without synchronizing (the device runs ahead whenever the host is the bound)."""

    call: str
    backend: str
    best_us: float
    median_us: float


HOST_CALLS, HOST_ROUNDS = 50, 5


def _host_call_us(fn: Callable, env: Env) -> tuple:
    """(best, median) µs per call of ``fn`` over HOST_ROUNDS rounds of HOST_CALLS calls, after a warm-up call
    (a dry run: two rounds of two)."""
    calls, rounds = (2, 2) if env.dry_run else (HOST_CALLS, HOST_ROUNDS)
    fn()
    env.synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        env.synchronize()
    per_call.sort()
    return per_call[0], per_call[len(per_call) // 2]


class _TimedLaunches:
    """Wraps the Triton depth-read launcher's kernels (``attnres_kernels.triton.depth_attention_ops``) to time each
    ``kernel[grid](...)`` call on the host: Triton's own launch path (argument binding, specialization,
    the driver call), apart from the launcher's Python around it."""

    KERNELS = ("depth_attn_fwd_kernel", "depth_attn_bwd_kernel", "column_sum_kernel")

    def __init__(self):
        from attnres_kernels.triton import depth_attention_ops as launch

        self.launch, self.times = launch, {name: [] for name in self.KERNELS}
        self.originals = {name: getattr(launch, name) for name in self.KERNELS}

    def __enter__(self):
        for name, kernel in self.originals.items():
            setattr(self.launch, name, self._timed(name, kernel))
        return self

    def __exit__(self, *exc):
        for name, kernel in self.originals.items():
            setattr(self.launch, name, kernel)

    def _timed(self, name: str, kernel):
        times = self.times[name]

        class Timed:
            def __getitem__(self, grid):
                launcher = kernel[grid]

                def run(*args, **kwargs):
                    start = time.perf_counter()
                    launcher(*args, **kwargs)
                    times.append((time.perf_counter() - start) * 1e6)

                return run

        return Timed()


def bench_host(env: Env) -> list:
    """Where the host's time goes in a depth read (N = 9, M = 8192, D = 1024, bf16, one site with its
    key-norm weight): plain PyTorch calls for scale (one elementwise kernel; N chained adds, forward and
    forward + ``autograd.grad``: the autograd engine's own cost for N leaves), then on each fused backend
    the public function, ``read_unchecked`` (as the nn modules call it), the raw forward and backward ops
    without autograd, and for Triton its own launch of each kernel."""
    case = ReadCase(3, 1, 4, 16, 1, torch.bfloat16) if env.dry_run else ReadCase(9, 4, 2048, 1024, 1, torch.bfloat16)
    sources, w, gamma, grad_out = make_inputs(case, env.device)
    sources = [s.detach().requires_grad_() for s in sources]
    w, gamma = w.detach().requires_grad_(), gamma.detach().requires_grad_()
    leaves = [*sources, w, gamma]
    rows = []

    def add(call: str, backend: str, fn: Callable) -> None:
        rows.append(HostRow(call, backend, *_host_call_us(fn, env)))

    def no_grad(fn: Callable) -> Callable:
        def run():
            with torch.no_grad():
                return fn()

        return run

    def chain():
        total = sources[0] * 1.0
        for s in sources[1:]:
            total = total + s
        return total

    a = torch.empty_like(grad_out)
    add("`empty_like` + `add_` (one elementwise kernel)", "torch", no_grad(lambda: torch.empty_like(a).add_(grad_out)))
    add(f"{case.n} chained adds, forward", "torch", no_grad(chain))
    add(
        f"{case.n} chained adds, forward + `autograd.grad`",
        "torch",
        lambda: torch.autograd.grad(chain(), sources, grad_out),
    )
    options = ReadOptions(eps=EPS)
    for backend in ("triton", "cuda", "cpu"):
        if backend not in ak.available_backends(env.device, case.dim, case.dtype):
            continue
        public = lambda b=backend: ak.depth_attention(w, sources, gamma, eps=EPS, backend=b)
        unchecked = lambda b=backend: read_unchecked(b, sources, w, gamma, options=options)
        for name, read in (("`depth_attention`", public), ("`read_unchecked`", unchecked)):
            add(f"{name}, forward", backend, no_grad(read))
            add(
                f"{name}, forward + `autograd.grad`", backend, lambda r=read: torch.autograd.grad(r(), leaves, grad_out)
            )
        fwd_op = _dispatch.fused_op(backend, "depth_attn_fwd", env.device)
        bwd_op = _dispatch.fused_op(backend, "depth_attn_bwd", env.device)
        with torch.no_grad():
            _, _, logits, rinv = fwd_op(sources, w, gamma, None, None, None, *options)
        add(
            "raw forward op (no autograd)",
            backend,
            no_grad(lambda f=fwd_op: f(sources, w, gamma, None, None, None, *options)),
        )
        raw_bwd = lambda b=bwd_op: b(grad_out, None, None, sources, w, gamma, None, None, None, logits, rinv, *options)
        add("raw backward op (no autograd)", backend, no_grad(raw_bwd))
        if backend == "triton":
            with _TimedLaunches() as launches:
                for _ in range(2 if env.dry_run else 60):
                    torch.autograd.grad(public(), leaves, grad_out)
            env.synchronize()
            for kernel, times in launches.times.items():
                times = sorted(times[len(times) // 6 :])  # after the first sixth (warm-up)
                if times:
                    rows.append(HostRow(f"Triton's launch of `{kernel}`", backend, times[0], times[len(times) // 2]))
    return rows
