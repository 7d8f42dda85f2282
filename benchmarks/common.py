"""Helpers shared by the pytest-benchmark suite and the benchmark scripts."""

from __future__ import annotations

import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

import attnres_kernels as ak
from attnres_kernels import reference


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo names it, with its family/model and the vector extensions the
    kernels and PyTorch's may use (the shared VMs differ between sessions: a Cascade Lake
    without AVX512-BF16 on some days, an AMX machine on others)."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return "unknown CPU"
    info = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(info.get("flags", "").split())
    extensions = [name for flag, name in FLAG_NAMES if flag in flags]
    name, family, model = info.get("model name", "unknown CPU"), info.get("cpu family", "?"), info.get("model", "?")
    return f"{name} (family {family} model {model}; {', '.join(extensions) or 'no AVX-512'})"


FLAG_NAMES = (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The checkout's commit, marked when tracked files other than the reports differ from it."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short=12", "HEAD")
    if head.returncode:
        return "unknown (not a git checkout)"
    dirty = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks/results").returncode != 0
    return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def load_average() -> str:
    """The 1 / 5 / 15 minute load averages, or "unknown"."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def report_header(title: str, argv: list | None = None, device: str | None = None) -> str:
    """The first lines of a report: its title, then the command that wrote it (the running script,
    relative to the repository root when inside it, with ``argv``, by default ``sys.argv[1:]``), the
    commit, date, device (by default the CPU), software and the load average."""
    script = os.path.abspath(sys.argv[0])
    if script.startswith(REPO_ROOT + os.sep):
        script = os.path.relpath(script, REPO_ROOT)
    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- commit: {git_commit()}",
        f"- date: {date}",
        f"- device: {device or cpu_description()}, {os.cpu_count()} logical CPUs",
        f"- software: torch {torch.__version__}, Python {sys.version.split()[0]}; {ak.build_info()}",
        f"- load average (1 / 5 / 15 min) at the start: {load_average()}",
        "",
    ]
    return "\n".join(lines)


def run_times(fn, min_runs: int = 5, min_seconds: float = 0.5, warmup: int = 1, setup=None) -> list:
    """Wall times of ``fn()`` over at least ``min_runs`` runs and ``min_seconds``;
    ``setup()`` runs untimed before every run (and before every warmup run)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_seconds(fn, min_runs: int = 5, min_seconds: float = 0.5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over at least ``min_runs`` runs and ``min_seconds``."""
    return statistics.median(run_times(fn, min_runs, min_seconds, warmup))


def spread(times: list) -> dict:
    """Median, min, max and interquartile range of ``times`` (seconds)."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return dict(median=statistics.median(times), min=min(times), max=max(times), iqr=q3 - q1, runs=len(times))


def empty_output_cache() -> None:
    """Frees the CPU output buffers the C++ ops keep for reuse, so that the next call's
    outputs are fresh allocations that page-fault on first touch."""
    torch.ops.attnres.empty_cpu_cache()


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


def copy_source(rows: int, dim: int, dtype: torch.dtype, n: int):
    """``n`` [rows, dim] tensors' worth of data (as one tensor), and the bytes a copy of it moves (read + write)."""
    src = torch.randn(n * rows, dim).to(dtype)
    return src, 2 * src.numel() * src.element_size()


def tensor_copy(rows: int, dim: int, dtype: torch.dtype, n: int):
    """``copy_`` of ``n`` [rows, dim] tensors' worth into a preallocated (reused) tensor, and the bytes it moves."""
    src, nbytes = copy_source(rows, dim, dtype, n)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src), nbytes


def tensor_clone(rows: int, dim: int, dtype: torch.dtype, n: int):
    """``clone`` of ``n`` [rows, dim] tensors' worth (a fresh output every call), and the bytes it moves."""
    src, nbytes = copy_source(rows, dim, dtype, n)
    return lambda: src.clone(), nbytes


def saved_activation_bytes(fn) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward while running ``fn``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
