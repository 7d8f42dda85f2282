"""GPU benchmark of the depth read, attention, the Block step and training steps; writes Markdown and JSON.

    python benchmarks/gpu.py [--out benchmarks/results] [--quick] [--rep 100] [--skip-models]
    python benchmarks/gpu.py --dry-run [--out DIR]        # no GPU: exercises the same code on tiny CPU tensors
    make gpu-bench                                         # pytest -m cuda, then this script

Depth read (DESIGN.md §2.1, §6): forward and forward+backward timed with
``triton.testing.do_bench`` (median and 20/80 % quantiles, L2 flushed before each run) for

- ours: the Triton backend and the CUDA backend;
- baselines: the eager reference and ``torch.compile`` of it (Inductor), and a device-to-device
  copy into a reused buffer of as many bytes as the forward's I/O floor (the bandwidth reference);
- peers, when their package is installed (see :data:`PEERS` for how each API is called):
  fla-core's ``fla.ops.attnres.fused_attnres``, liger-kernel's ``LigerAttnResFunction``,
  fast-attnres's ``attnres``, and flash-attn-res's phase-1 op (multi-query).

Every timed implementation is first checked for accuracy in the same run: its output and
gradients against an fp32 oracle (the reference on fp32 copies of the inputs), with
FlashAttention's rule (error at most 3x that of the eager reference in the input precision, plus
a small slack); a failing implementation is marked FAIL in the report. An implementation that
is not installed or cannot run a case (no CUDA build of ours yet, a peer's width or dtype limits)
is listed as skipped with the reason, never as an error; one that raises is listed as an error.

Host vs device (:meth:`Env.split`): for every timed op, the host's cost to issue one call (µs,
calls not synchronized) and the time of its kernels (``torch.profiler``, CUDA activity), and
which of the two bounds it; the same per training step. A call whose host cost exceeds its
kernels' time is host-bound: do_bench then times the Python call path, not the kernels.

Attention: causal ``ak.attention`` on the Triton and CUDA backends against PyTorch's
``scaled_dot_product_attention`` (B = 4, H = 16, T = 2048, Dh = 64 and 128, bf16), checked by
the same rule (the same-precision baseline is plain PyTorch attention in bf16, FlashAttention's).

Host cost (:func:`bench_host`): where the host's time goes in one depth read on each fused backend (the
public function, ``read_unchecked``, the raw ops, Triton's own launch of each kernel) beside plain PyTorch
calls for scale, the autograd engine's cost for as many leaves among them.

Block step: ``ak.block_step`` (``partial + update`` and the next site's merge read with its
PreNorm, M = 4 x 2048 rows, D = 1024, bf16, prefix from a read over 4 blocks) on the Triton and
CUDA backends and the eager reference, outputs and every input gradient checked.

Inkling2: one transformers ``Inkling2BlockAttentionResidual`` (Q = 1 and 3) unpatched and patched by
``attnres_kernels.hf.apply_attnres_kernels``, forward + backward time and saved bytes; and an AdamW
training step of a random bf16 ``Inkling2ForCausalLM`` (``benchmarks/inkling2_model.py``'s model,
sized up) unpatched, with its reads patched, and with reads and norms fused, with peak memory.

Models: one AdamW training step (bf16 autocast: fp32 parameters and embedding, bf16 sublayers,
so the depth reads see mixed dtypes) of Standard, Full and Block AttnRes at d=1024, L=12,
T=1024 on the fused kernels (``backend="auto"``) and on the reference depth read, with the peak
memory of the step and its device time (profiler over 2 steps); on a GPU also Standard, Full and
Block with their forward and backward replayed from CUDA graphs (``torch.cuda.make_graphed_callables``).

``--dry-run`` runs the same code paths on tiny CPU tensors: Triton under its interpreter
(``TRITON_INTERPRET=1``), a ``perf_counter`` timer instead of ``do_bench``, ``torch.compile``
with the ``aot_eager`` backend, the C++ CPU kernels in the models. Its numbers mean nothing; it
exists so that ``tests/test_gpu_benchmark_script.py`` can check the script's logic without a GPU.
Without ``--out`` a dry run prints its report and writes no file.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

# --dry-run needs the interpreter chosen before Triton kernels are first imported.
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import attnres_kernels as ak  # noqa: E402
from attnres_kernels import reference  # noqa: E402
from attnres_kernels._validation import ReadOptions  # noqa: E402
from attnres_kernels.ops import _dispatch  # noqa: E402
from attnres_kernels.ops.depth_attention import read_unchecked  # noqa: E402

EPS = 1e-6
QUANTILES = [0.5, 0.2, 0.8]
# Slack of the accuracy rule, relative to the oracle's magnitude (as tests/support.py's ATOL).
SLACK = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ERROR_FACTOR = 3.0


# ---------------------------------------------------------------- environment


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


# ---------------------------------------------------------------- depth-read cases


@dataclass(frozen=True)
class ReadCase:
    """One depth read: ``n`` sources ``[batch, seq, dim]`` of ``dtype`` read by ``q`` sites
    (``q = 1``: a ``[D]`` query; more: ``[Q, D]`` parameters, one multi-query read)."""

    n: int
    batch: int
    seq: int
    dim: int
    q: int
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    @property
    def label(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"N={self.n} Q={self.q} M={self.rows} D={self.dim} {dtype}"

    def floor_bytes(self, backward: bool) -> int:
        """I/O floor: forward reads the N sources and writes Q outputs; the backward adds
        one more read of the sources and of the Q output gradients and writes N gradients."""
        units = self.n + self.q + (2 * self.n + self.q if backward else 0)
        return units * self.rows * self.dim * torch.empty((), dtype=self.dtype).element_size()


def read_cases(dry_run: bool, quick: bool) -> list:
    if dry_run:
        return [ReadCase(3, 1, 3, 16, 1, torch.bfloat16), ReadCase(3, 1, 2, 8, 2, torch.float32)]
    bf16 = torch.bfloat16
    cases = [ReadCase(n, 4, 2048, d, 1, bf16) for d in (1024, 4096) for n in (3, 9, 17, 33)]
    cases += [ReadCase(n, 4, 2048, 2048, 4, bf16) for n in (4, 8)]  # multi-query: the Block phase-1 read
    cases += [ReadCase(9, 4, 2048, 1024, 1, torch.float32)]
    if quick:
        cases = [cases[1], cases[4 + 1], cases[8]]
    return cases


def make_inputs(case: ReadCase, device: torch.device, seed: int = 0):
    """Sources ``[batch, seq, dim]``, ``w`` and ``γ`` (``[D]`` or ``[Q, D]``, fp32) and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.seq, case.dim)
    sources = [torch.randn(shape, generator=gen).to(device, case.dtype) for _ in range(case.n)]
    site = (case.dim,) if case.q == 1 else (case.q, case.dim)
    w = (2 / math.sqrt(case.dim) * torch.randn(site, generator=gen)).to(device)  # logits of a few units
    gamma = (1 + 0.1 * torch.randn(site, generator=gen)).to(device)
    out_shape = shape if case.q == 1 else (case.q, *shape)
    grad_out = torch.randn(out_shape, generator=gen).to(device, case.dtype)
    return sources, w, gamma, grad_out


# ---------------------------------------------------------------- implementations


class Skip(Exception):
    """An implementation that cannot run this case (not installed, not built, out of its limits)."""


def _unavailable_reason(exc: ak.BackendUnavailableError) -> str:
    """Why a backend cannot run a call, without the "backend 'x' cannot run this call: " preamble."""
    return str(exc).split(": ", 1)[-1]


def _failure_status(exc: Exception) -> str:
    """A row's status after ``exc``: a backend or package that cannot run is skipped with its reason;
    anything else is an error, reported so that the other rows still run."""
    if isinstance(exc, Skip):
        return f"skipped: {exc}"
    if isinstance(exc, ak.BackendUnavailableError):
        return f"skipped: {_unavailable_reason(exc)}"
    return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@dataclass
class Impl:
    """A depth-read implementation: ``read(sources, w, gamma) -> [Q?, ..., D]`` (differentiable)."""

    name: str
    kind: str  # "ours", "baseline" or "peer"
    make: Callable  # (case, env) -> read function; raises Skip when unavailable
    note: str = ""


def _ours(backend: str):
    def make(case: ReadCase, env: Env):
        try:
            ak.ops.resolve_backend(backend, env.device, case.dim, case.dtype)
        except ak.BackendUnavailableError as exc:
            raise Skip(_unavailable_reason(exc)) from None
        return lambda sources, w, gamma: ak.depth_attention(w, sources, gamma, eps=EPS, backend=backend)

    return make


def _reference(case: ReadCase, env: Env):
    return lambda sources, w, gamma: reference.depth_attention(w, sources, gamma, eps=EPS)


def _compiled_reference(case: ReadCase, env: Env):
    # Each case compiles a graph of its own shapes: without the reset, Dynamo reaches its recompile limit after a few
    # cases and runs the eager function from then on, silently (an H100 sweep's compiled rows equalled eager).
    torch._dynamo.reset()
    compiled = torch.compile(reference.depth_attention, backend=env.compile_backend, dynamic=False)
    return lambda sources, w, gamma: compiled(w, sources, gamma, eps=EPS)


def _import_peer(module: str, attr: str, package: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise Skip(f"{package} is not installed ({exc})") from None
    except AttributeError:
        raise Skip(f"{package} is installed but has no {module}.{attr}") from None


def _needs_cuda(env: Env, package: str) -> None:
    if env.device.type != "cuda":
        raise Skip(f"{package} runs on CUDA tensors only")


def _per_site(read_one: Callable) -> Callable:
    """A single-query peer API used for Q sites: Q calls (each rescans the sources), stacked."""

    def read(sources, w, gamma):
        if w.dim() == 1:
            return read_one(sources, w, gamma)
        return torch.stack([read_one(sources, w[k], gamma[k]) for k in range(w.shape[0])])

    return read


def _fla(case: ReadCase, env: Env):
    """``fused_attnres(query, residuals, rms_weight, rms_eps=..., scale=1.0)``: the same math as
    ours (``s_i = scale · <query, rmsnorm(v_i) ⊙ rms_weight>``); query = w, rms_weight = γ,
    residuals = the list of sources (no stacking on our side), scale 1."""
    fused_attnres = _import_peer("fla.ops.attnres", "fused_attnres", "fla-core")
    _needs_cuda(env, "fla-core")
    return _per_site(lambda sources, w, gamma: fused_attnres(w, list(sources), gamma, rms_eps=EPS, scale=1.0))


def _liger(case: ReadCase, env: Env):
    """``LigerAttnResFunction.apply(V, w_query, w_norm, eps)`` with ``V = stack(sources)`` ``[N, ..., D]``
    (liger takes stacked values: the stack copy is part of its cost); w_query = w, w_norm = γ."""
    fn = _import_peer("liger_kernel.ops.attn_res", "LigerAttnResFunction", "liger-kernel")
    _needs_cuda(env, "liger-kernel")
    return _per_site(lambda sources, w, gamma: fn.apply(torch.stack(list(sources)), w, gamma, EPS))


def _fast_attnres(case: ReadCase, env: Env):
    """``attnres(values, query, eps=..., scale=1.0)``: no key-norm weight (its logits are
    ``rsqrt(mean(v²) + eps) · <query, v>``), so ``query = w ⊙ γ`` (folded inside the timed
    call; gradients reach w and γ through the product); values = the list of sources."""
    attnres = _import_peer("attnres", "attnres", "fast-attnres")
    _needs_cuda(env, "fast-attnres")
    if case.dtype not in (torch.bfloat16, torch.float32):
        raise Skip("fast-attnres takes bf16 or fp32 values")
    return _per_site(lambda sources, w, gamma: attnres(list(sources), w * gamma, eps=EPS, scale=1.0))


def _flash_attn_res(case: ReadCase, env: Env):
    """Phase 1 of flash-attn-res (the batched inter-block read of a block's S sites):
    ``phase_1_batched_attention_triton_op(blocks [N, B, T, D], pseudo_queries [S, D], eps)``
    returns (bf16 outputs ``[S, B, T, D]``, lse). It has no key-norm weight, so
    ``pseudo_queries = w ⊙ γ``; the sources are stacked (its input is one tensor); it needs a
    power-of-two D and writes bf16."""
    op = _import_peer("flash_attn_res", "phase_1_batched_attention_triton_op", "flash-attn-res")
    _needs_cuda(env, "flash-attn-res")
    if case.dim & (case.dim - 1):
        raise Skip("flash-attn-res needs a power-of-two D")
    if case.dtype != torch.bfloat16:
        raise Skip("flash-attn-res phase 1 writes bf16 outputs only")

    def read(sources, w, gamma):
        u = (w * gamma).reshape(-1, case.dim)
        out, _lse = op(torch.stack(list(sources)), u, EPS)
        return out[0] if w.dim() == 1 else out

    return read


IMPLS = [
    Impl("triton (ours)", "ours", _ours("triton")),
    Impl("cuda (ours)", "ours", _ours("cuda")),
    Impl("reference, eager", "baseline", _reference),
    Impl("reference, torch.compile", "baseline", _compiled_reference),
    Impl("fla fused_attnres", "peer", _fla, "Q > 1: one call per site"),
    Impl("liger attn_res", "peer", _liger, "stacked V; Q > 1: one call per site"),
    Impl("fast-attnres", "peer", _fast_attnres, "query = w ⊙ γ; Q > 1: one call per site"),
    Impl("flash-attn-res phase 1", "peer", _flash_attn_res, "pseudo-queries = w ⊙ γ; stacked sources"),
]
PEERS = {impl.name: impl.make.__doc__ for impl in IMPLS if impl.kind == "peer"}


# ---------------------------------------------------------------- accuracy


def _leaves(sources, w, gamma):
    return (
        [s.detach().clone().requires_grad_() for s in sources],
        w.detach().clone().requires_grad_(),
        (gamma.detach().clone().requires_grad_()),
    )


def run_with_grads(read: Callable, sources, w, gamma, grad_out, dtype=None):
    """Output and gradients (sources concatenated, w, γ) of one read, inputs cast to ``dtype``."""
    if dtype is not None:
        sources, w, gamma, grad_out = [s.to(dtype) for s in sources], w.to(dtype), gamma.to(dtype), grad_out.to(dtype)
    sources, w, gamma = _leaves(sources, w, gamma)
    out = read(sources, w, gamma)
    leaves = [*sources, w, gamma]
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]  # an ignored input: zeros
    d_sources = torch.cat([g.flatten() for g in grads[:-2]])
    return {"out": out.detach(), "d_sources": d_sources, "d_w": grads[-2], "d_gamma": grads[-1]}


@dataclass
class Accuracy:
    ok: bool
    errors: dict  # name -> max abs error / max |oracle|
    reference_errors: dict  # the same for the eager reference in the input precision


def compare_to_oracle(got: dict, oracle: dict, same_precision: dict, dtype: torch.dtype) -> Accuracy:
    """FlashAttention's rule on every named output and gradient: error against the fp32 ``oracle`` at most
    :data:`ERROR_FACTOR` times that of ``same_precision`` plus :data:`SLACK` of ``dtype`` (the inputs')."""
    errors, reference_errors, ok = {}, {}, True
    for name, want in oracle.items():
        scale = want.abs().max().item()
        err = (got[name].float() - want).abs().max().item()
        base = (same_precision[name].float() - want).abs().max().item()
        slack = SLACK.get(dtype, 1e-5) * (1.0 + scale)
        ok = ok and got[name].shape == want.shape and err <= ERROR_FACTOR * base + slack
        errors[name] = err / max(scale, 1e-30)
        reference_errors[name] = base / max(scale, 1e-30)
    return Accuracy(ok, errors, reference_errors)


def check_accuracy(read: Callable, case: ReadCase, inputs, oracle: dict, same_precision: dict) -> Accuracy:
    return compare_to_oracle(run_with_grads(read, *inputs), oracle, same_precision, case.dtype)


def outputs_and_grads(fn: Callable, inputs: dict, grad_outputs: dict, dtype=None) -> dict:
    """The outputs of ``fn(**inputs)`` (one tensor or a tuple, named as ``grad_outputs``) and the
    gradients ``d_<input>`` of every input (zeros for an input ``fn`` ignores), with the inputs cast to
    ``dtype``."""
    leaves = {name: x.detach().to(dtype or x.dtype).requires_grad_() for name, x in inputs.items()}
    outs = _as_tuple(fn(**leaves))
    grads = [g.to(out.dtype) for g, out in zip(grad_outputs.values(), outs)]
    grads = torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True)
    result = {name: out.detach() for name, out in zip(grad_outputs, outs)}
    for (name, x), grad in zip(leaves.items(), grads):
        result[f"d_{name}"] = torch.zeros_like(x) if grad is None else grad
    return result


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


# ---------------------------------------------------------------- depth-read benchmark


@dataclass
class Row:
    """One implementation on one case of the depth read, attention or the Block step (no GB/s for the last two)."""

    case: str
    impl: str
    kind: str
    status: str  # "ok", "FAIL" (accuracy), "skipped: ...", "error: ..."
    fwd_ms: tuple | None = None
    fwd_bwd_ms: tuple | None = None
    fwd_gbps: float | None = None
    fwd_bwd_gbps: float | None = None
    accuracy: dict = field(default_factory=dict)
    fwd_split: Split | None = None
    fwd_bwd_split: Split | None = None

    def record_accuracy(self, accuracy: Accuracy) -> None:
        self.accuracy = {"errors": accuracy.errors, "reference_errors": accuracy.reference_errors}
        self.status = "ok" if accuracy.ok else "FAIL"

    def measure(self, env: Env, forward: Callable, forward_backward: Callable) -> None:
        """do_bench times and host/device splits of ``forward`` (run under no_grad) and ``forward_backward``."""
        with torch.no_grad():
            self.fwd_ms = env.timer(forward)
            self.fwd_split = env.split(forward)
        self.fwd_bwd_ms = env.timer(forward_backward)
        self.fwd_bwd_split = env.split(forward_backward)


def bench_case(case: ReadCase, env: Env, impls: list) -> tuple:
    """Times every implementation on one case; returns (rows, copy GB/s)."""
    sources, w, gamma, grad_out = make_inputs(case, env.device)
    inputs = (sources, w, gamma, grad_out)
    oracle = run_with_grads(_reference(case, env), *inputs, dtype=torch.float32)
    same_precision = run_with_grads(_reference(case, env), *inputs)
    # Bandwidth reference: a copy into a reused buffer moving the forward's floor in bytes.
    copy_src = torch.empty(case.floor_bytes(backward=False) // 2, dtype=torch.uint8, device=env.device)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = env.timer(lambda: copy_dst.copy_(copy_src))
    copy_gbps = 2 * copy_src.numel() / copy_ms[0] / 1e6
    rows = []
    for impl in impls:
        row = Row(case.label, impl.name, impl.kind, "ok")
        try:
            read = impl.make(case, env)
            row.record_accuracy(check_accuracy(read, case, inputs, oracle, same_precision))
            leaves = _leaves(sources, w, gamma)

            def fwd_bwd():
                out = read(*leaves)
                return torch.autograd.grad(out, [*leaves[0], leaves[1], leaves[2]], grad_out.to(out.dtype))

            row.measure(env, lambda: read(*leaves), fwd_bwd)
            row.fwd_gbps = case.floor_bytes(False) / row.fwd_ms[0] / 1e6
            row.fwd_bwd_gbps = case.floor_bytes(True) / row.fwd_bwd_ms[0] / 1e6
        except Exception as exc:  # a peer that breaks must not stop the benchmark
            row.status = _failure_status(exc)
        rows.append(row)
        env.synchronize()
    return rows, copy_gbps


# ---------------------------------------------------------------- attention and the Block step


@dataclass(frozen=True)
class OpImpl:
    """An implementation of attention or of the Block step: ``fn(**inputs)``, differentiable."""

    name: str
    kind: str  # "ours" or "baseline"
    fn: Callable


def bench_op(
    label: str,
    impls: list,
    inputs: dict,
    grad_outputs: dict,
    oracle: Callable,
    same_precision: Callable,
    dtype: torch.dtype,
    env: Env,
) -> list:
    """Checks, then times, each implementation on ``inputs`` (named tensors): its outputs and the
    gradients of every input against ``oracle`` run on fp32 copies, by the rule of
    :func:`compare_to_oracle` with ``same_precision`` run on the inputs (of ``dtype``) as the baseline."""
    want = outputs_and_grads(oracle, inputs, grad_outputs, torch.float32)
    baseline = outputs_and_grads(same_precision, inputs, grad_outputs)
    rows = []
    for impl in impls:
        row = Row(label, impl.name, impl.kind, "ok")
        try:
            got = outputs_and_grads(impl.fn, inputs, grad_outputs)
            row.record_accuracy(compare_to_oracle(got, want, baseline, dtype))
            leaves = {name: x.detach().requires_grad_() for name, x in inputs.items()}

            def fwd_bwd():
                outs = _as_tuple(impl.fn(**leaves))
                grads = [g.to(o.dtype) for g, o in zip(grad_outputs.values(), outs)]
                return torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True)

            row.measure(env, lambda: impl.fn(**leaves), fwd_bwd)
        except Exception as exc:  # a backend that is not built is skipped; one that breaks is an error
            row.status = _failure_status(exc)
        rows.append(row)
        env.synchronize()
    return rows


def _eager_attention(q, k, v):
    """Causal attention in plain PyTorch ops in the inputs' dtype, the same-precision baseline of
    FlashAttention's tests. (``reference.attention`` computes in fp32 and rounds once; the kernels,
    like this, round the probabilities to the input dtype for their P·V product.)"""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


ATTENTION_IMPLS = [
    OpImpl("triton (ours)", "ours", lambda q, k, v: ak.attention(q, k, v, causal=True, backend="triton")),
    OpImpl("cuda (ours)", "ours", lambda q, k, v: ak.attention(q, k, v, causal=True, backend="cuda")),
    OpImpl("torch SDPA", "baseline", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
]


def bench_attention(env: Env) -> dict:
    """Causal attention, q, k, v ``[B, H, T, Dh]``, per head size: ``{label: rows}``."""
    dtype = torch.bfloat16
    shapes = [(1, 2, 8, 16)] if env.dry_run else [(4, 16, 2048, head_dim) for head_dim in (64, 128)]
    results = {}
    for batch, heads, seq, head_dim in shapes:
        label = f"B={batch} H={heads} T={seq} Dh={head_dim} causal {str(dtype).removeprefix('torch.')}"
        gen = torch.Generator().manual_seed(0)
        q, k, v, grad_out = (
            torch.randn(batch, heads, seq, head_dim, generator=gen).to(env.device, dtype) for _ in range(4)
        )
        inputs, grad_outputs = {"q": q, "k": k, "v": v}, {"out": grad_out}
        oracle = functools.partial(reference.attention, causal=True)
        results[label] = bench_op(label, ATTENTION_IMPLS, inputs, grad_outputs, oracle, _eager_attention, dtype, env)
    return results


def _block_step(backend: str) -> Callable:
    """``ak.block_step`` on ``backend``, called with the inputs by name."""

    def step(partial, update, query, prefix_out, prefix_lse, norm_weight, out_norm_weight):
        return ak.block_step(
            partial,
            update,
            query,
            prefix_out,
            prefix_lse,
            norm_weight,
            eps=EPS,
            out_norm_weight=out_norm_weight,
            backend=backend,
        )

    return step


BLOCK_STEP_IMPLS = [
    OpImpl("triton (ours)", "ours", _block_step("triton")),
    OpImpl("cuda (ours)", "ours", _block_step("cuda")),
    OpImpl("reference, eager", "baseline", _block_step("reference")),
]


def bench_block_step(env: Env) -> dict:
    """The Block step of a site with its PreNorm (``out_norm_weight``), as the Block model runs it:
    bf16 addends; the prefix ``(out, lse)`` is the site's read over the committed blocks. Returns
    ``{label: rows}``."""
    batch, seq, dim, blocks = (1, 4, 16, 4) if env.dry_run else (4, 2048, 1024, 4)
    dtype = torch.bfloat16
    label = f"M={batch * seq} D={dim} {str(dtype).removeprefix('torch.')}, prefix over {blocks} blocks"
    gen = torch.Generator().manual_seed(0)
    activation = lambda: torch.randn(batch, seq, dim, generator=gen).to(env.device, dtype)
    site = lambda mean, std: (mean + std * torch.randn(dim, generator=gen)).to(env.device)
    query, norm_weight, out_norm_weight = site(0.0, 2 / math.sqrt(dim)), site(1.0, 0.1), site(1.0, 0.1)
    committed = [activation() for _ in range(blocks)]
    prefix_out, prefix_lse = reference.depth_attention(query, committed, norm_weight, eps=EPS, return_lse=True)
    inputs = {
        "partial": activation(),
        "update": activation(),
        "query": query,
        "prefix_out": prefix_out,
        "prefix_lse": prefix_lse,
        "norm_weight": norm_weight,
        "out_norm_weight": out_norm_weight,
    }
    grad_outputs = {"new_partial": activation(), "out": activation()}
    reference_step = _block_step("reference")
    rows = bench_op(label, BLOCK_STEP_IMPLS, inputs, grad_outputs, reference_step, reference_step, dtype, env)
    return {label: rows}


# ---------------------------------------------------------------- host cost of a read


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


# ---------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int
    layers_per_block: int


def model_config(dry_run: bool, batch: int) -> ModelConfig:
    if dry_run:
        return ModelConfig(vocab=32, d_model=16, layers=2, heads=2, seq=4, batch=1, layers_per_block=1)
    return ModelConfig(vocab=32000, d_model=1024, layers=12, heads=16, seq=1024, batch=batch, layers_per_block=2)


def build_model(name: str, cfg: ModelConfig, backend: str) -> torch.nn.Module:
    # A model's attention follows its `backend` (attention_backend="auto"): the CUDA C++ rows compare the depth
    # reads alone, so their attention stays on what "auto" picks on a GPU (Triton), not the SIMT CUDA kernel.
    attention = "triton" if backend == "cuda" else "auto"
    common = dict(
        vocab_size=cfg.vocab,
        d_model=cfg.d_model,
        n_layers=cfg.layers,
        n_heads=cfg.heads,
        backend=backend,
        attention_backend=attention,
    )
    if name == "Standard":
        return ak.nn.StandardTransformer(**common)
    if name == "Full":
        return ak.nn.FullAttnResTransformer(**common)
    return ak.nn.BlockAttnResTransformer(**common, layers_per_block=cfg.layers_per_block)


@dataclass
class ModelRow:
    model: str
    depth_read: str
    status: str
    step_ms: tuple | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    step_split: Split | None = None


def _train_step(name: str, cfg: ModelConfig, backend: str, device: torch.device, graphed: bool = False) -> Callable:
    """One AdamW step of a fresh model on a fixed batch, under bf16 autocast. ``graphed``: the model's
    forward and backward captured by ``torch.cuda.make_graphed_callables`` (autocast without its cast
    cache, as capture requires), the loss and the AdamW step eager."""
    torch.manual_seed(0)
    model = build_model(name, cfg, backend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), device=device)
    inputs = idx[:, :-1].contiguous()
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, cache_enabled=not graphed)
    if graphed:
        with autocast():
            model = torch.cuda.make_graphed_callables(model, (inputs,))

    def step():
        with autocast():
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bench_models(cfg: ModelConfig, env: Env) -> list:
    """One AdamW step per model and depth-read backend, under bf16 autocast. The fused reads use
    ``backend="auto"`` on a GPU, and ``"cuda"`` (the C++ kernels) beside it; a dry run asks for
    ``"triton"`` (the interpreter), the backend "auto" picks on a GPU. The models' attention follows
    their ``backend``, except in the ``"cuda"`` rows, whose attention runs on Triton (:func:`build_model`)."""
    fused = "triton" if env.dry_run else "auto"
    runs = [("Standard", fused), ("Full", fused), ("Full", "reference"), ("Block", fused), ("Block", "reference")]
    runs = [(name, backend, False) for name, backend in runs]
    if not env.dry_run:  # the CUDA C++ reads: fewer host µs per call than Triton's, more device time
        runs[3:3] = [("Full", "cuda", False)]
        runs.append(("Block", "cuda", False))
    if env.device.type == "cuda":  # the steps are host-bound: the same steps replayed from CUDA graphs
        runs += [(name, fused, True) for name in ("Standard", "Full", "Block")]
    rows = []
    for name, backend, graphed in runs:
        row = ModelRow(f"{name}, CUDA graph" if graphed else name, "-" if name == "Standard" else backend, "ok")
        try:
            if backend != "reference" and name != "Standard":
                row.depth_read = ak.ops.resolve_backend(backend, env.device, cfg.d_model, torch.bfloat16)
            step = _train_step(name, cfg, backend, env.device, graphed)
            if env.device.type == "cuda":  # (a dry run's times mean nothing: no warm-up step)
                step()
                torch.cuda.reset_peak_memory_stats(env.device)
            row.step_ms = env.timer(step)
            row.tokens_per_s = cfg.batch * cfg.seq / row.step_ms[0] * 1e3
            if env.device.type == "cuda":
                row.peak_mib = torch.cuda.max_memory_allocated(env.device) / 2**20
            row.step_split = env.split(step, calls=2)
            step = None  # frees the model before the next one is built
        except Exception as exc:  # e.g. out of memory on a small GPU: reported, the rest still runs
            row.status = _failure_status(exc)
        rows.append(row)
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- Inkling2 read modules


@dataclass
class Inkling2Row:
    queries: int
    partial: str
    status: str
    unpatched_ms: tuple | None = None
    patched_ms: tuple | None = None
    unpatched_saved_mib: float | None = None
    patched_saved_mib: float | None = None


def bench_inkling2_reads(env: Env) -> list:
    """One transformers ``Inkling2BlockAttentionResidual`` (Q = 1 and 3 queries over 4 committed bf16
    blocks and the partial sum, bf16 or fp32, T = 4096 tokens, D = 1024) unpatched and patched by
    ``attnres_kernels.hf.apply_attnres_kernels``: forward + backward time and the bytes autograd saves
    (``benchmarks/inkling2_read.py`` measures the same on CPU)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import inkling2_read

    tokens, dim = (8, 16) if env.dry_run else (4096, 1024)
    rows = []
    for queries in (1, 3):
        for partial_dtype in (torch.bfloat16, torch.float32):
            row = Inkling2Row(queries, str(partial_dtype).removeprefix("torch."), "ok")
            try:
                unpatched = inkling2_read.make_module(dim, queries).to(env.device)
                patched = inkling2_read.patched_copy(unpatched)
                gen = torch.Generator(env.device).manual_seed(0)
                blocks = torch.randn(1, tokens, 4, dim, device=env.device, generator=gen).bfloat16().requires_grad_()
                partial = torch.randn(1, tokens, dim, device=env.device, generator=gen).to(partial_dtype)
                partial.requires_grad_()
                for name, module in (("unpatched", unpatched), ("patched", patched)):
                    step = lambda module=module: inkling2_read.fwd_bwd(module, blocks, partial)
                    setattr(row, f"{name}_ms", env.timer(step))
                    saved = inkling2_read.saved_bytes(module, blocks, partial)
                    setattr(row, f"{name}_saved_mib", saved / 2**20)
            except Exception as exc:  # reported, the rest still runs
                row.status = _failure_status(exc)
            rows.append(row)
    return rows


@dataclass
class Inkling2StepRow:
    variant: str
    status: str
    step_ms: tuple | None = None
    peak_mib: float | None = None
    loss: float | None = None
    step_split: Split | None = None


def inkling2_model_args(dry_run: bool):
    """The model of ``benchmarks/inkling2_model.py`` at GPU size (tiny in a dry run)."""
    import argparse

    if dry_run:
        return argparse.Namespace(hidden=32, layers=4, block=2, tokens=8, batch=1)
    return argparse.Namespace(hidden=1024, layers=8, block=3, tokens=2048, batch=4)


def bench_inkling2_model(env: Env) -> tuple:
    """An AdamW step (forward with labels, backward, step) of a random ``Inkling2ForCausalLM`` loaded in
    bf16, for each of ``inkling2_model.VARIANTS`` (reads on ``backend="auto"``) and, on a GPU, the default
    patch on the CUDA C++ kernels, one variant on the device at a time; the first step's loss is reported
    so that the variants can be compared. Returns ``(model args, rows)``."""
    import shutil
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import inkling2_model

    args = inkling2_model_args(env.dry_run)
    path = tempfile.mkdtemp(prefix="inkling2_gpu_bench_")
    rows = []
    try:
        inkling2_model.make_model(args).save_pretrained(path)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 2000, (args.batch, args.tokens), generator=gen).to(env.device)
        runs = [(name, "auto") for name in inkling2_model.VARIANTS]
        if not env.dry_run:
            runs.append(("reads+norms", "cuda"))
        for name, backend in runs:
            row = Inkling2StepRow(name if backend == "auto" else f"{name}, {backend}", "ok")
            try:
                model = inkling2_model.variant(path, name, torch.bfloat16, backend).to(env.device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

                def step(model=model, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    loss = model(ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    return loss

                row.loss = step().item()
                if env.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(env.device)
                row.step_ms = env.timer(step)
                if env.device.type == "cuda":
                    row.peak_mib = torch.cuda.max_memory_allocated(env.device) / 2**20
                row.step_split = env.split(step, calls=2)
            except Exception as exc:  # reported, the other variants still run
                row.status = _failure_status(exc)
            model = opt = step = None  # frees this variant before the next one is loaded
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
    finally:
        shutil.rmtree(path)
    return args, rows


# ---------------------------------------------------------------- report


def _ms(t) -> str:
    return "–" if t is None else f"{t[0]:.3f} ({t[1]:.3f}–{t[2]:.3f})"


def _gbps(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _ratio(a, b) -> str:
    return "–" if a is None or b is None else f"{b[0] / a[0]:.2f}×"


def _error(row: Row) -> str:
    if not row.accuracy:
        return "–"
    return f"{max(row.accuracy['errors'].values()):.1e} ({max(row.accuracy['reference_errors'].values()):.1e})"


def _host_us(split: Split | None) -> str:
    return "–" if split is None else f"{split.host_us:.0f}"


def _device_ms(split: Split | None) -> str:
    return "–" if split is None or split.device_ms is None else f"{split.device_ms:.3f}"


def _bound_by(split: Split | None) -> str:
    return "–" if split is None else split.bound_by


SPLIT_COLUMNS = "fwd host µs/call | fwd device ms | fwd+bwd host µs/call | fwd+bwd device ms | bound by"


def _split_cells(row: Row) -> str:
    """The cells of :data:`SPLIT_COLUMNS`; what bounds the row is what bounds its fwd+bwd."""
    fwd, fwd_bwd = row.fwd_split, row.fwd_bwd_split
    cells = [_host_us(fwd), _device_ms(fwd), _host_us(fwd_bwd), _device_ms(fwd_bwd), _bound_by(fwd_bwd)]
    return " | ".join(cells)


def _op_section(title: str, intro: list, cases: dict, baseline: str, short: str) -> list:
    """A report section: its title, intro lines and one ``_op_table`` per case (nothing without cases)."""
    if not cases:
        return []
    lines = ["", f"## {title}", "", *intro]
    for case, rows in cases.items():
        lines += ["", f"### {case}", "", *_op_table(rows, baseline, short)]
    return lines


def _op_table(rows: list, baseline: str, short: str) -> list:
    """One case of attention or the Block step: times, speed-ups over ``baseline`` (named ``short``
    in the header), the host/device split and the accuracy."""
    base = next((r for r in rows if r.impl == baseline and r.fwd_ms), None)
    lines = [
        f"| implementation | status | fwd ms | fwd ×{short} | fwd+bwd ms | fwd+bwd ×{short} | {SPLIT_COLUMNS} "
        "| error (ref) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.impl} | {r.status} | {_ms(r.fwd_ms)} | {_ratio(r.fwd_ms, base.fwd_ms if base else None)} | "
            f"{_ms(r.fwd_bwd_ms)} | {_ratio(r.fwd_bwd_ms, base.fwd_bwd_ms if base else None)} | {_split_cells(r)} | "
            f"{_error(r)} |"
        )
    return lines


def markdown(
    env_info: dict,
    read_rows: list,
    copies: dict,
    model_rows: list,
    cfg: ModelConfig | None,
    inkling2_rows: list = (),
    inkling2_step: tuple | None = None,
    attention_rows: dict | None = None,
    block_step_rows: dict | None = None,
    host_rows: list = (),
) -> str:
    lines = ["# GPU benchmark" + (" (DRY RUN on CPU: numbers are meaningless)" if env_info["dry_run"] else ""), ""]
    lines += [f"- {k}: {v}" for k, v in env_info.items()]
    lines += [
        "",
        "## Depth read",
        "",
        "Times in ms: median (20 %–80 % quantiles). GB/s: the I/O floor (forward: N sources read, Q outputs",
        "written; forward+backward adds a second read of the sources and of the output gradients and the N",
        "source gradients) over the median time; `copy` is a device copy of the forward's floor in bytes into a",
        "reused buffer. Speed-ups are over the eager reference and over `torch.compile` of it. Accuracy: max",
        "error / max |oracle| against an fp32 oracle, worst of output and gradients, next to the eager",
        "reference's in the input precision; FAIL = more than 3x the reference's error plus slack.",
        "",
        "The second table of each case splits the cost of one call: host µs/call is the time the host takes to",
        "issue it (calls not synchronized); device ms is the time of its kernels (torch.profiler). When the host",
        "takes longer than the kernels (bound by `host`), the device waits for the host and the ms above time the",
        "Python call path, not the kernels.",
        "",
    ]
    for case, rows in read_rows.items():
        eager = next((r for r in rows if r.impl == "reference, eager" and r.fwd_ms), None)
        compiled = next((r for r in rows if r.impl == "reference, torch.compile" and r.fwd_ms), None)
        lines += [f"### {case} (copy: {_gbps(copies[case])} GB/s)", ""]
        lines += [
            "| implementation | status | fwd ms | fwd GB/s | fwd ×eager | fwd ×compile | fwd+bwd ms | fwd+bwd GB/s "
            "| fwd+bwd ×eager | fwd+bwd ×compile | error (ref) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r.impl} | {r.status} | {_ms(r.fwd_ms)} | {_gbps(r.fwd_gbps)} | "
                f"{_ratio(r.fwd_ms, eager.fwd_ms if eager else None)} | "
                f"{_ratio(r.fwd_ms, compiled.fwd_ms if compiled else None)} | {_ms(r.fwd_bwd_ms)} | "
                f"{_gbps(r.fwd_bwd_gbps)} | {_ratio(r.fwd_bwd_ms, eager.fwd_bwd_ms if eager else None)} | "
                f"{_ratio(r.fwd_bwd_ms, compiled.fwd_bwd_ms if compiled else None)} | {_error(r)} |"
            )
        lines += ["", f"| implementation | {SPLIT_COLUMNS} |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.impl} | {_split_cells(r)} |" for r in rows if r.fwd_split is not None]
        lines.append("")
    lines += ["## How the peers are called", ""]
    lines += [f"- **{name}**: {' '.join(doc.split())}" for name, doc in PEERS.items()]
    lines += _op_section(
        "Attention",
        [
            "`ak.attention(q, k, v, causal=True)` on our backends and PyTorch's `scaled_dot_product_attention`",
            "(cuDNN or FlashAttention on a GPU); q, k, v `[B, H, T, Dh]`. ×SDPA: SDPA's time over the row's (above 1:",
            "faster than SDPA). Host/device columns as in the depth read. Accuracy as in the depth read, except that",
            "the same-precision baseline is plain PyTorch attention in the input dtype (FlashAttention's rule).",
        ],
        attention_rows,
        "torch SDPA",
        "SDPA",
    )
    lines += _op_section(
        "Block step",
        [
            "`ak.block_step`: `partial + update` and the next site's read merged with its phase-1 prefix, PreNorm",
            "fused (`out_norm_weight`), as the Block model runs it. ×eager: the eager reference's time over the",
            "row's. Accuracy: outputs (new partial, read) and the gradients of every input, as in the depth read.",
        ],
        block_step_rows,
        "reference, eager",
        "eager",
    )
    if host_rows:
        lines += [
            "",
            "## Host cost of a depth read",
            "",
            "µs per call on the host, best and median of rounds of calls issued without synchronizing (the device",
            "runs ahead whenever the host is the bound): plain PyTorch calls for scale, then each fused backend's",
            "read (`depth_attention`; `read_unchecked`, as the nn modules call it; the raw ops without autograd) and",
            "Triton's own `kernel[grid](...)` launch of each kernel, timed around the call. The read: N = 9 bf16",
            "sources of [4, 2048, 1024], one site with its key-norm weight (a dry run: 3 of [1, 4, 16]).",
            "",
            "| call | backend | best µs | median µs |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r.call} | {r.backend} | {r.best_us:.1f} | {r.median_us:.1f} |" for r in host_rows]
    if cfg is not None and model_rows:
        lines += [
            "",
            "## Training step",
            "",
            f"AdamW step under bf16 autocast: d={cfg.d_model}, L={cfg.layers}, heads={cfg.heads}, T={cfg.seq}, "
            f"batch {cfg.batch}, vocab {cfg.vocab}, Block with {cfg.layers_per_block} layers per block. "
            "device ms/step: the kernels' time of one step (torch.profiler over 2 steps); bound by `host` when "
            "issuing a step takes the host longer than that (ms/step then exceeds the device time). The model's "
            "`backend` runs its attention too, except in the `cuda` rows (CUDA C++ depth reads, Triton attention). "
            "`CUDA graph`: the model's forward and backward captured by `torch.cuda.make_graphed_callables` and "
            "replayed (autocast without its cast cache), the loss and the AdamW step eager.",
            "",
            "| model | depth read | status | ms/step | × Standard | tokens/s | peak MiB | device ms/step | bound by |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        standard = next((r for r in model_rows if r.model == "Standard" and r.step_ms), None)
        for r in model_rows:
            ratio = "–" if standard is None or r.step_ms is None else f"{r.step_ms[0] / standard.step_ms[0]:.2f}×"
            peak = "–" if r.peak_mib is None else f"{r.peak_mib:.0f}"
            tps = "–" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}"
            lines.append(
                f"| {r.model} | {r.depth_read} | {r.status} | {_ms(r.step_ms)} | {ratio} | {tps} | {peak} | "
                f"{_device_ms(r.step_split)} | {_bound_by(r.step_split)} |"
            )
    if inkling2_rows:
        lines += [
            "",
            "## Inkling2 read module, patched vs unpatched",
            "",
            "transformers' `Inkling2BlockAttentionResidual` (4 committed bf16 blocks + the partial sum, T = 4096, "
            "D = 1024, fp32 output), forward + backward, unpatched and patched by "
            "`attnres_kernels.hf.apply_attnres_kernels`; saved MiB: tensors autograd keeps that are not the inputs.",
            "",
            "| Q | partial | status | unpatched ms | patched ms | speedup | saved MiB unpatched | patched |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in inkling2_rows:
            mib = lambda x: "–" if x is None else f"{x:.1f}"
            lines.append(
                f"| {r.queries} | {r.partial} | {r.status} | {_ms(r.unpatched_ms)} | {_ms(r.patched_ms)} | "
                f"{_ratio(r.patched_ms, r.unpatched_ms)} | {mib(r.unpatched_saved_mib)} | {mib(r.patched_saved_mib)} |"
            )
    if inkling2_step is not None:
        args, step_rows = inkling2_step
        lines += [
            "",
            "## Inkling2 training step, patched vs unpatched",
            "",
            f"A random `Inkling2ForCausalLM` loaded in bf16 (`benchmarks/inkling2_model.py`'s model: hidden "
            f"{args.hidden}, {args.layers} layers, full attention every 4th, AttnRes blocks of {args.block} layers, "
            f"4 experts top 2), B = {args.batch}, T = {args.tokens}; one AdamW step. `reads`: "
            "`apply_attnres_kernels(model, fuse_norms=False)`; `reads+norms`: the default (reads fused with the "
            'RMSNorm after each); `, cuda`: the same patch with `backend="cuda"` (the C++ kernels). device ms/step '
            "and bound by as in the training-step table.",
            "",
            "| variant | status | ms/step | speedup | peak MiB | first loss | device ms/step | bound by |",
            "|---|---|---|---|---|---|---|---|",
        ]
        unpatched = next((r for r in step_rows if r.variant == "unpatched" and r.step_ms), None)
        for r in step_rows:
            peak = "–" if r.peak_mib is None else f"{r.peak_mib:.0f}"
            loss = "–" if r.loss is None else f"{r.loss:.4f}"
            lines.append(
                f"| {r.variant} | {r.status} | {_ms(r.step_ms)} | "
                f"{_ratio(r.step_ms, unpatched.step_ms if unpatched else None)} | {peak} | {loss} | "
                f"{_device_ms(r.step_split)} | {_bound_by(r.step_split)} |"
            )
    return "\n".join(lines) + "\n"


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    return obj


SECTIONS = ["reads", "attention", "block_step", "host", "models", "inkling2_reads", "inkling2_step"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of the same code (no GPU needed)")
    parser.add_argument("--out", default=None, help="directory for gpu.md / gpu.json (default: benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="three depth-read cases instead of the full sweep")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per measurement, ms")
    parser.add_argument("--skip-models", action="store_true", help="skip the model training-step benchmark")
    parser.add_argument("--model-batch", type=int, default=4)
    parser.add_argument(
        "--sections", nargs="*", choices=SECTIONS, default=SECTIONS, help="the report's sections to measure (all)"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these depth-read implementations (names as listed)"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    env = Env(
        device=torch.device("cpu" if args.dry_run else "cuda"),
        dry_run=args.dry_run,
        rep_ms=args.rep,
        compile_backend="aot_eager" if args.dry_run else "inductor",
    )
    impls = [i for i in IMPLS if args.only is None or i.name in args.only]
    env_info = describe_environment(env)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda x, **_: x
    read_rows, copies = {}, {}
    attention_rows, block_step_rows, model_rows, inkling2_rows, host_rows = {}, {}, [], [], []
    cfg = None if args.skip_models else model_config(args.dry_run, args.model_batch)
    inkling2_step = None
    out_dir = (
        args.out if args.out is not None else (None if args.dry_run else os.path.join(ROOT, "benchmarks", "results"))
    )

    def write_report() -> str:
        """The report of the sections measured so far, written after each one (a run cut short keeps them)."""
        report = markdown(
            env_info,
            read_rows,
            copies,
            model_rows,
            cfg,
            inkling2_rows,
            inkling2_step,
            attention_rows,
            block_step_rows,
            host_rows,
        )
        if out_dir is None:
            return report
        result = {
            "environment": env_info,
            "depth_read": {case: [asdict(r) for r in rows] for case, rows in read_rows.items()},
            "copy_gbps": copies,
            "attention": {case: [asdict(r) for r in rows] for case, rows in attention_rows.items()},
            "block_step": {case: [asdict(r) for r in rows] for case, rows in block_step_rows.items()},
            "host": [asdict(r) for r in host_rows],
            "models": {"config": asdict(cfg) if cfg else None, "rows": [asdict(r) for r in model_rows]},
            "inkling2_reads": [asdict(r) for r in inkling2_rows],
            "inkling2_step": None
            if inkling2_step is None
            else {"model": vars(inkling2_step[0]), "rows": [asdict(r) for r in inkling2_step[1]]},
        }
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gpu.md"), "w") as f:
            f.write(report)
        with open(os.path.join(out_dir, "gpu.json"), "w") as f:
            json.dump(_jsonable(result), f, indent=1)
        return report

    if "reads" in args.sections:
        for case in tqdm(read_cases(args.dry_run, args.quick), desc="depth read"):
            read_rows[case.label], copies[case.label] = bench_case(case, env, impls)
            write_report()
    if "attention" in args.sections:
        attention_rows.update(bench_attention(env))
        write_report()
    if "block_step" in args.sections:
        block_step_rows.update(bench_block_step(env))
        write_report()
    if "host" in args.sections:
        host_rows += bench_host(env)
        write_report()
    if cfg is not None and "models" in args.sections:
        model_rows += bench_models(cfg, env)
        write_report()
    if "inkling2_reads" in args.sections:
        inkling2_rows += bench_inkling2_reads(env)
        write_report()
    if not args.skip_models and "inkling2_step" in args.sections:
        inkling2_step = bench_inkling2_model(env)
    report = write_report()
    if out_dir is None:
        print(report)
        return 0
    print(report)
    print(f"wrote {os.path.join(out_dir, 'gpu.md')} and gpu.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
