"""The depth-read section: cases, the implementations timed (ours, baselines, peers), the accuracy
check against an fp32 oracle, and the benchmark of one case."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import attnres_kernels as ak
from attnres_kernels import reference

from .environment import EPS, ERROR_FACTOR, SLACK, Env, Skip, Split, failure_status, unavailable_reason

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
            raise Skip(unavailable_reason(exc)) from None
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
    outs = as_tuple(fn(**leaves))
    grads = [g.to(out.dtype) for g, out in zip(grad_outputs.values(), outs)]
    grads = torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True)
    result = {name: out.detach() for name, out in zip(grad_outputs, outs)}
    for (name, x), grad in zip(leaves.items(), grads):
        result[f"d_{name}"] = torch.zeros_like(x) if grad is None else grad
    return result


def as_tuple(outputs) -> tuple:
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
            row.status = failure_status(exc)
        rows.append(row)
        env.synchronize()
    return rows, copy_gbps
