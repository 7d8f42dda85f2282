"""Shared test helpers: random inputs in awkward layouts, oracle comparisons, op spies."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Absolute slack on top of the "k x the error of a same-precision PyTorch run" rule,
# relative to the magnitude of the oracle (at least 1). For fp32 it is ~160 ulps of a
# unit value: with logits of magnitude ~20 (D = 1000, unit-scale inputs) a 1-2 ulp
# difference in a logit moves the gradients by |<do, v>| ~ sqrt(D) times more, whatever
# the gradient's own size, so which of two correct fp32 implementations lands closer to
# fp64 is largely luck (measured: up to 12x apart over 200 seeds; a Block step's d_query
# of magnitude 0.045, cancelled by the softmax, was off by 2.0e-5 against the
# reference's 4e-7). A wrong formula is off by orders of magnitude, and fp64 gradcheck
# checks the formulas exactly.
ATOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make_sources(
    n: int, lead: tuple, d: int, dtype=torch.float32, layout: str = "contiguous", scale: float = 1.0
) -> list:
    """N random sources of shape ``lead + (d,)``.

    ``layout``: "contiguous"; "strided" (every other column of a wider tensor,
    so rows are not contiguous); "transposed" (the first two dims swapped, so the
    leading dims cannot be flattened without a copy)."""
    out = []
    for _ in range(n):
        if layout == "contiguous":
            t = torch.randn(*lead, d, dtype=torch.float64) * scale
        elif layout == "strided":
            t = (torch.randn(*lead, 2 * d, dtype=torch.float64) * scale)[..., ::2]
        elif layout == "transposed":
            assert len(lead) >= 2
            t = (torch.randn(lead[1], lead[0], *lead[2:], d, dtype=torch.float64) * scale).transpose(0, 1)
        else:
            raise ValueError(layout)
        out.append(t.to(dtype))
    return out


def site_params(q, d, dtype=torch.float32):
    """Query, key-norm weight and output-norm weight for Q sites (Q=None: one [D] site)."""
    shape = (d,) if q is None else (q, d)
    return (
        torch.randn(shape, dtype=dtype) * 0.5,
        1 + 0.3 * torch.randn(shape, dtype=dtype),
        1 + 0.3 * torch.randn(shape, dtype=dtype),
    )


def model_variants(chunk_size: int = 3) -> dict:
    """The nn models as the tests build them, every schedule of every model: name -> (class name in
    ``attnres_kernels.nn`` and ``attnres_kernels.reference``, the nn constructor's keyword arguments).
    ``chunk_size``: the sites per multi-query read of the chunked Full model."""
    return {
        "Standard": ("StandardTransformer", {}),
        "Full": ("FullAttnResTransformer", {"chunk_size": 1}),
        "Full-chunked": ("FullAttnResTransformer", {"chunk_size": chunk_size}),
        "Block-per-site": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "per_site"}),
        "Block-two-phase": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "two_phase"}),
    }


# A fused kernel rounds in a different order than PyTorch: its max error is
# typically 0.3x-2.5x that of the same-precision reference.
ERROR_FACTOR = 3.0


def assert_close_to_oracle(name, actual, same_precision, oracle):
    """FlashAttention's rule: the error of ``actual`` against the fp64 ``oracle``
    is bounded by a multiple of that of a same-precision PyTorch run, plus a small slack."""
    oracle = oracle.double()
    err = (actual.double() - oracle).abs().max().item()
    base = (same_precision.double() - oracle).abs().max().item()
    slack = ATOL[actual.dtype] * (1.0 + oracle.abs().max().item())
    assert err <= ERROR_FACTOR * base + slack, f"{name}: error {err:.3e} > {ERROR_FACTOR} x {base:.3e} + {slack:.3e}"


def attnres_ops_called(fn) -> set:
    """Names of the attnres custom ops the dispatcher ran while calling ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("attnres")}


def read_with_grads(fn, sources, params, out_weights):
    """Runs one depth read and returns its outputs plus the gradients of a random
    linear function of all outputs w.r.t. sources and parameters."""
    sources = [s.detach().clone().requires_grad_() for s in sources]
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in params]
    outs = fn(sources, *params)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, out_weights))
    leaves = sources + [p for p in params if p is not None]
    grads = torch.autograd.grad(loss, leaves)
    return list(outs), list(grads)


def reference_and_oracle(ref_fn, sources, params, out_weights):
    """The reference run at the inputs' own precision and in fp64."""
    same = read_with_grads(ref_fn, sources, params, out_weights)
    oracle = read_with_grads(
        ref_fn, [s.double() for s in sources], [p.double() if p is not None else None for p in params], out_weights
    )
    return same, oracle


def spawn_ranks(worker, world: int, args: tuple, timeout_s: float) -> None:
    """Runs ``worker(rank, *args)`` in ``world`` spawned processes (gloo tests on CPU); raises if a
    rank fails, and fails the test, killing the ranks, if they have not finished after ``timeout_s``
    (a hang never blocks the suite)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # raises if a rank failed
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the distributed ranks did not finish within {timeout_s} s")


def run_check_in_subprocess(module: str, call: str, env: dict[str, str | None]) -> None:
    """Runs ``module.call`` (a check function of a test module, named as imported: its ``__name__``,
    which raises on failure) in a fresh Python process whose environment is this one's with ``env``
    applied (None unsets a variable): for settings the native ops read once per process, seeded with
    this test's seed (a fresh process's torch seed is random, so a failure could not be replayed).
    Fails the test unless the check passed."""
    root = Path(__file__).resolve().parents[1]
    child_env = {**os.environ, "PYTHONPATH": str(root)}
    for name, value in env.items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    code = f"import torch, {module}; torch.manual_seed({torch.initial_seed()}); {module}.{call}; print('checked')"
    result = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "checked" in result.stdout, result.stderr


def assert_backward_checks_saved_tensors(fwd, bwd) -> None:
    """The depth read's backward op ``bwd`` (a backend's ``depth_attn_bwd``) accepts the tensors
    its forward ``fwd`` saved and rejects, before any kernel runs, an output gradient, saved
    logits or key-norm scales, or an lse / logits gradient of the wrong shape or dtype, naming it."""
    from attnres_kernels._validation import PAPER_READ

    sources = [torch.randn(3, 5, 8) for _ in range(2)]
    query = torch.randn(2, 8)  # two sites: out [2, 3, 5, 8], lse [2, 3, 5], logits [2, 2, 3, 5], rinv [2, 3, 5]
    out, lse, logits, rinv = fwd(sources, query, None, None, None, None, *PAPER_READ)
    good = [torch.randn_like(out), torch.randn_like(lse), torch.randn_like(logits), sources, query]
    good += [None, None, None, None, logits, rinv, *PAPER_READ]
    grads = bwd(*good)
    assert [tuple(g.shape) for g in grads[0]] == [(3, 5, 8)] * 2 and grads[1].shape == query.shape
    for index, bad, name in [
        (0, out[..., :-1], "grad_out"),
        (0, out.double(), "grad_out"),
        (1, lse[:1], "grad_lse"),
        (2, logits.double(), "grad_logits"),
        (9, logits[:, :1], "logits"),
        (10, rinv.double(), "rinv"),
    ]:
        args = list(good)
        args[index] = bad
        with pytest.raises(RuntimeError, match=f"depth_attn_bwd: `{name}` must be"):
            bwd(*args)
