"""Where and how the GPU benchmark runs: the timer, the host/device split of a call, the environment
the report names, and how a row that cannot run is reported."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

import attnres_kernels as ak

# The repository and its benchmarks/ folder (the scripts the Inkling2 sections import).
BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)

EPS = 1e-6
QUANTILES = [0.5, 0.2, 0.8]
# Slack of the accuracy rule, relative to the oracle's magnitude (as tests/support.py's ATOL).
SLACK = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ERROR_FACTOR = 3.0


@dataclass(frozen=True)
class Split:
    """The cost of one call on each side: the host's time to issue it and its kernels' time."""

    host_us: float
    device_ms: float | None  # None without CUDA (a dry run)

    @property
    def bound_by(self) -> str:
        """``host`` when issuing the call takes longer than running its kernels, else ``device``."""
        if self.device_ms is None:
            return "–"
        return "host" if self.host_us > self.device_ms * 1e3 else "device"


@dataclass
class Env:
    """Where and how the benchmark runs."""

    device: torch.device
    dry_run: bool
    rep_ms: int
    compile_backend: str

    def timer(self, fn: Callable) -> tuple:
        """``(median, p20, p80)`` milliseconds of ``fn()``."""
        if not self.dry_run:
            import triton.testing

            return tuple(triton.testing.do_bench(fn, rep=self.rep_ms, quantiles=QUANTILES))
        start = time.perf_counter()  # a dry run times one call (its times mean nothing)
        fn()
        elapsed = (time.perf_counter() - start) * 1e3
        return elapsed, elapsed, elapsed

    def split(self, fn: Callable, calls: int = 10) -> Split:
        """Host µs and device ms per call of ``fn`` (after one warm-up call). The host time is that of
        ``calls`` calls issued without synchronizing: the cost of the Python call path and the launches,
        which is the wall time whenever the device runs ahead of the host. The device time is the
        kernels' time summed by the profiler over ``calls`` more calls. A dry run makes one call, without
        the warm-up (every split follows a :meth:`timer` of the same ``fn``), and measures no device time."""
        if self.dry_run:
            start = time.perf_counter()
            fn()
            return Split((time.perf_counter() - start) * 1e6, None)
        fn()
        self.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us = (time.perf_counter() - start) / calls * 1e6
        self.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        device_us = 0.0
        for event in prof.key_averages():
            self_us = getattr(event, "self_device_time_total", None)  # older torch: self_cuda_time_total
            device_us += event.self_cuda_time_total if self_us is None else self_us
        return Split(host_us, device_us / calls / 1e3)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def describe_environment(env: Env) -> dict:
    info = {
        "device": torch.cuda.get_device_name(env.device)
        if env.device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dry_run": env.dry_run,
        "timer": "perf_counter (dry run)" if env.dry_run else f"triton.testing.do_bench(rep={env.rep_ms} ms)",
        "torch.compile backend": env.compile_backend,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["attnres_kernels build"] = ak.build_info()
    return info


class Skip(Exception):
    """An implementation that cannot run this case (not installed, not built, out of its limits)."""


def unavailable_reason(exc: ak.BackendUnavailableError) -> str:
    """Why a backend cannot run a call, without the "backend 'x' cannot run this call: " preamble."""
    return str(exc).split(": ", 1)[-1]


def failure_status(exc: Exception) -> str:
    """A row's status after ``exc``: a backend or package that cannot run is skipped with its reason;
    anything else is an error, reported so that the other rows still run."""
    if isinstance(exc, Skip):
        return f"skipped: {exc}"
    if isinstance(exc, ak.BackendUnavailableError):
        return f"skipped: {unavailable_reason(exc)}"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
