"""The attention and Block-step sections: each op on our backends and its plain-PyTorch baseline,
checked and timed like the depth read."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnres_kernels as ak
from attnres_kernels import reference

from .environment import EPS, Env, failure_status
from .reads import Row, as_tuple, compare_to_oracle, outputs_and_grads


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
                outs = as_tuple(impl.fn(**leaves))
                grads = [g.to(o.dtype) for g, o in zip(grad_outputs.values(), outs)]
                return torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True)

            row.measure(env, lambda: impl.fn(**leaves), fwd_bwd)
        except Exception as exc:  # a backend that is not built is skipped; one that breaks is an error
            row.status = failure_status(exc)
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
