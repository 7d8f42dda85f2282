"""The depth read (DESIGN.md §2.1): :func:`depth_attention` and :func:`depth_attention_merge`.

Both validate their arguments in Python (:mod:`attnres_kernels._validation`),
pick a backend (:mod:`attnres_kernels.ops._dispatch`) and run either the
reference or the backend's ``depth_attn_fwd`` op, whose fake kernel and
autograd are registered in :mod:`attnres_kernels.ops._registration` (the C++
op's autograd in ``csrc/autograd``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from .._validation import Sources, check_depth_read, check_prefix_args
from . import _dispatch, _native
from ._registration import register_native_depth_attn_ops

if _native.available():
    register_native_depth_attn_ops()


def _limit(dim: int, dtype: torch.dtype):
    def limit(backend: str) -> str | None:
        if backend == "triton":
            from .. import triton as triton_backend

            if dim > triton_backend.max_dim(dtype):
                return f"the Triton kernels support D <= {triton_backend.max_dim(dtype)} for {dtype}, got D = {dim}"
        return None

    return limit


def resolve_backend(backend: str, device: torch.device, dim: int, dtype: torch.dtype = torch.float32) -> str:
    """The backend that will run a depth read of ``dtype`` sources of width ``dim`` on ``device``."""
    return _dispatch.resolve(backend, device, "depth_attn_fwd", _limit(dim, dtype), what=f" (D = {dim}, {dtype})")


def available_backends(device: torch.device | str = "cpu", dim: int = 1, dtype: torch.dtype = torch.float32) -> list:
    """Backends that can run a depth read of ``dtype`` sources of width ``dim`` on ``device`` right now."""
    device = torch.device(device)
    limit = _limit(dim, dtype)
    return [
        b for b in _dispatch.BACKENDS[1:] if _dispatch.unavailable_reason(b, device, "depth_attn_fwd", limit) is None
    ]


def read_unchecked(
    backend: str,
    sources: list,
    query: Tensor,
    norm_weight: Tensor | None = None,
    *,
    prefix: tuple | None = None,
    out_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    return_lse: bool = False,
    return_weights: bool = False,
):
    """A depth read without argument checks, for modules that already guarantee
    what :func:`depth_attention` checks (a list of same-shape, same-device sources of
    supported dtypes; ``[D]`` or ``[Q, D]`` parameters; a ``(prefix_out, prefix_lse)``
    merge prefix with ``prefix_lse`` in the accumulation dtype) and that resolved
    ``backend`` once (:func:`resolve_backend`; ``"auto"`` is not accepted here).
    Same results as :func:`depth_attention` / :func:`depth_attention_merge`."""
    if backend == "reference":
        if prefix is None:
            return reference.depth_attention(
                query,
                sources,
                norm_weight,
                eps=eps,
                out_norm_weight=out_norm_weight,
                return_lse=return_lse,
                return_weights=return_weights,
            )
        return reference.depth_attention_merge(
            query, *prefix, sources, norm_weight, eps=eps, out_norm_weight=out_norm_weight, return_lse=return_lse
        )
    return _run_fused(
        backend, sources, query, norm_weight, prefix or (None, None), out_norm_weight, eps, return_lse, return_weights
    )


def _run_fused(backend, sources, query, norm_weight, prefix, out_norm_weight, eps, return_lse, return_weights):
    prefix_out, prefix_lse = prefix
    out, lse, logits, _ = _dispatch.fused_op(backend, "depth_attn_fwd")(
        list(sources), query, norm_weight, prefix_out, prefix_lse, out_norm_weight, float(eps)
    )
    outputs = [out] + ([lse] if return_lse else [])
    if return_weights:
        # The weights are the softmax of the saved logits (not exp(logits - lse)): exact
        # to an ulp, and their backward is the plain softmax backward.
        outputs.append(torch.softmax(logits, dim=query.dim() - 1))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def depth_attention(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    return_lse: bool = False,
    return_weights: bool = False,
    backend: str = "auto",
):
    """Softmax attention over depth (DESIGN.md §2.1), fused.

    Same arguments and results as :func:`attnres_kernels.reference.depth_attention`,
    plus ``backend`` (see :mod:`attnres_kernels.ops`). Gradients flow to the sources,
    ``query``, ``norm_weight`` and ``out_norm_weight``, and through ``lse``
    and the weights when those are used.
    """
    args = check_depth_read(query, sources, norm_weight, out_norm_weight, eps)
    chosen = resolve_backend(backend, args.device, args.sources[0].shape[-1], args.dtype)
    if chosen == "reference":
        return reference.depth_attention(
            query,
            sources,
            norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
            return_lse=return_lse,
            return_weights=return_weights,
        )
    return _run_fused(
        chosen, args.sources, query, norm_weight, (None, None), out_norm_weight, eps, return_lse, return_weights
    )


def depth_attention_merge(
    query: Tensor,
    prefix_out: Tensor,
    prefix_lse: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Extends a read ``(prefix_out, prefix_lse)`` over sources A with sources B, fused.

    Equals :func:`depth_attention` over ``A ∪ B``; see
    :func:`attnres_kernels.reference.depth_attention_merge`.
    """
    args = check_prefix_args(
        check_depth_read(query, sources, norm_weight, out_norm_weight, eps), prefix_out, prefix_lse
    )
    chosen = resolve_backend(backend, args.device, args.sources[0].shape[-1], args.dtype)
    if chosen == "reference":
        return reference.depth_attention_merge(
            query,
            prefix_out,
            prefix_lse,
            sources,
            norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
            return_lse=return_lse,
        )
    prefix = (prefix_out, prefix_lse.to(args.acc_dtype))
    return _run_fused(chosen, args.sources, query, norm_weight, prefix, out_norm_weight, eps, return_lse, False)
