"""The depth read (DESIGN.md §2.1): :func:`depth_attention` and :func:`depth_attention_merge`.

Both validate their arguments in Python (:mod:`attnres_kernels._validation`),
pick a backend (:mod:`attnres_kernels.ops._dispatch`) and run either the
reference or the backend's ``depth_attn_fwd`` op (:func:`depth_attention` on
plain CPU tensors calls the C++ op straight away: it checks the arguments itself,
and the Python checks only word the error of a call it rejects), whose fake kernel and
autograd are registered in :mod:`attnres_kernels.ops._registration` (the C++
op's autograd in ``csrc/autograd``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import _backends, _native
from .._validation import (
    PAPER_READ,
    DepthReadArgs,
    ReadOptions,
    Sources,
    check_depth_read,
    check_prefix_args,
    check_read_options,
)
from ..reference import ops as reference_ops
from . import _dispatch
from ._registration import register_native_depth_attention_ops

if _native.available():
    register_native_depth_attention_ops()


def _limit(dim: int, dtype: torch.dtype, options: ReadOptions = PAPER_READ, weighted_values: bool = False):
    """The fused backends' limits for a read of ``dtype`` sources of width ``dim`` with
    ``options`` (``weighted_values``: normalised values times a key-norm weight)."""

    def limit(backend: str) -> str | None:
        if options.normalize_values and weighted_values and backend != "cuda":
            return "the fused kernels normalise the values only without a key-norm weight (norm_weight=None)"
        if options.key_rank is not None and backend != "cuda":
            return f"backend {backend!r} has no kernel for sliced low-rank keys (key_rank) yet"
        fused = _backends.get(backend)
        if fused.max_dim is not None and dim > fused.max_dim(dtype):
            return f"the {fused.title} kernels support D <= {fused.max_dim(dtype)} for {dtype}, got D = {dim}"
        return None

    return limit


def resolve_backend(
    backend: str,
    device: torch.device,
    dim: int,
    dtype: torch.dtype = torch.float32,
    options: ReadOptions = PAPER_READ,
    weighted_values: bool = False,
) -> str:
    """The backend that will run a depth read of ``dtype`` sources of width ``dim`` on ``device``
    with ``options`` (``weighted_values``: ``normalize_values`` with a key-norm weight)."""
    limit = _limit(dim, dtype, options, weighted_values)
    return _dispatch.resolve(backend, device, "depth_attn_fwd", limit, what=f" (D = {dim}, {dtype})")


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
    options: ReadOptions = PAPER_READ,
    return_lse: bool = False,
    return_weights: bool = False,
):
    """A depth read without argument checks, for modules that already guarantee
    what :func:`depth_attention` checks (a list of same-shape, same-device sources of
    supported dtypes; ``[D]`` or ``[Q, D]`` parameters; a ``(prefix_out, prefix_lse)``
    merge prefix with ``prefix_lse`` in the accumulation dtype; ``options`` from
    :func:`attnres_kernels._validation.check_read_options`) and that resolved
    ``backend`` once (:func:`resolve_backend`; ``"auto"`` is not accepted here).
    Same results as :func:`depth_attention` / :func:`depth_attention_merge`."""
    if backend == "reference":
        args = DepthReadArgs(tuple(sources), query, norm_weight, out_norm_weight, options)
        if prefix is None:
            return reference_ops.read(args, return_lse, return_weights)
        args = dataclasses.replace(args, prefix_dtype=prefix[0].dtype)
        return reference_ops.merge(args, *prefix, return_lse)
    prefix_out, prefix_lse = prefix or (None, None)
    out, lse, logits, _ = _dispatch.fused_op(backend, "depth_attn_fwd", sources[0].device)(
        list(sources), query, norm_weight, prefix_out, prefix_lse, out_norm_weight, *options
    )
    return _outputs(out, lse, logits, query, return_lse, return_weights)


def _outputs(out: Tensor, lse: Tensor, logits: Tensor, query: Tensor, return_lse: bool, return_weights: bool):
    """A fused read's results as the caller asked for them."""
    if not (return_lse or return_weights):
        return out
    outputs = [out] + ([lse] if return_lse else [])
    if return_weights:
        # The weights are the softmax of the saved logits (not exp(logits - lse)): exact
        # to an ulp, and their backward is the plain softmax backward.
        outputs.append(torch.softmax(logits, dim=query.dim() - 1))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


# What "auto" and "cpu" resolve to for CPU sources when the extension has the CPU kernel (which takes
# every width and dtype; only weighted normalised values go to the reference): known at import, so
# that a call skips the resolution (a small read's kernel is tens of µs, and the Python around it
# runs with cold caches after the kernel and autograd).
_CPU_KERNEL = _native.has_kernel("depth_attn_fwd", "cpu")
_CPU_OP = torch.ops.attnres.depth_attn_fwd.default if _CPU_KERNEL and _native.available() else None
# Argument types whose call dispatches like a plain tensor's (no subclass hooks: DTensor,
# fake or functional tensors go through the Python checks and the backend resolution).
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _plain_cpu_read(
    query, sources, norm_weight, out_norm_weight, eps, scale, normalize_values, out_norm_eps, key_rank
) -> bool:
    """Whether a read's arguments are plain CPU tensors in a list or tuple with options of the
    exact types the checks accept: a call the C++ op validates itself."""
    return (
        type(sources) in (list, tuple)
        and type(query) in _PLAIN_TENSORS
        and query.is_cpu
        and all(type(s) in _PLAIN_TENSORS and s.is_cpu for s in sources)
        and (norm_weight is None or (type(norm_weight) in _PLAIN_TENSORS and norm_weight.is_cpu))
        and (out_norm_weight is None or (type(out_norm_weight) in _PLAIN_TENSORS and out_norm_weight.is_cpu))
        and type(eps) is float
        and type(scale) is float
        and type(normalize_values) is bool
        and (out_norm_eps is None or type(out_norm_eps) is float)
        and not (normalize_values and norm_weight is not None)  # weighted normalised values: the reference
        and key_rank is None  # sliced low-rank keys: the reference
    )


def _read(args: DepthReadArgs, norm_weight, out_norm_weight, prefix, backend, return_lse, return_weights):
    """Runs a checked read (``args``; a merge when ``prefix`` is given) on the backend ``backend`` resolves to."""
    weighted_values = args.options.normalize_values and norm_weight is not None
    if (
        backend in _dispatch.CPU_KERNEL_BACKENDS
        and not weighted_values
        and args.options.key_rank is None
        and args.sources[0].is_cpu
        and _CPU_KERNEL
        and _native.available()
    ):
        chosen = "cpu"
    else:
        chosen = resolve_backend(
            backend, args.device, args.sources[0].shape[-1], args.compute_dtype, args.options, weighted_values
        )
    if prefix is not None and chosen != "reference":
        prefix = (prefix[0], prefix[1].to(args.acc_dtype))
    return read_unchecked(
        chosen,
        list(args.sources),
        args.site_query,
        norm_weight,
        prefix=prefix,
        out_norm_weight=out_norm_weight,
        options=args.options,
        return_lse=return_lse,
        return_weights=return_weights,
    )


def depth_attention(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    scale: float = 1.0,
    normalize_values: bool = False,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    key_rank: int | None = None,
    return_lse: bool = False,
    return_weights: bool = False,
    backend: str = "auto",
):
    """Softmax attention over depth (DESIGN.md §2.1, §2.7), fused.

    Same arguments and results as :func:`attnres_kernels.reference.depth_attention`,
    plus ``backend`` (see :mod:`attnres_kernels.ops`). Gradients flow to the sources,
    ``query``, ``norm_weight`` and ``out_norm_weight``, and through ``lse``
    and the weights when those are used.
    """
    if (
        _CPU_OP is not None
        and backend in _dispatch.CPU_KERNEL_BACKENDS
        and _native.available()
        and _plain_cpu_read(
            query, sources, norm_weight, out_norm_weight, eps, scale, normalize_values, out_norm_eps, key_rank
        )
    ):
        # The C++ op checks every argument before its kernel runs; the Python checks (~13 µs with
        # the resolution, 7 % of a small read's forward) run only to word the error of a call it rejected.
        try:
            out, lse, logits, _ = _CPU_OP(
                sources, query, norm_weight, None, None, out_norm_weight, eps,
                eps if out_norm_eps is None else out_norm_eps, scale, normalize_values, out_dtype, None,
            )  # fmt: skip
        except (RuntimeError, TypeError):
            options = check_read_options(
                eps,
                scale=scale,
                normalize_values=normalize_values,
                out_norm_eps=out_norm_eps,
                out_dtype=out_dtype,
                key_rank=key_rank,
            )
            check_depth_read(query, sources, norm_weight, out_norm_weight, options)
            raise
        return _outputs(out, lse, logits, query, return_lse, return_weights)
    options = check_read_options(
        eps,
        scale=scale,
        normalize_values=normalize_values,
        out_norm_eps=out_norm_eps,
        out_dtype=out_dtype,
        key_rank=key_rank,
    )
    args = check_depth_read(query, sources, norm_weight, out_norm_weight, options)
    return _read(args, norm_weight, out_norm_weight, None, backend, return_lse, return_weights)


def depth_attention_merge(
    query: Tensor,
    prefix_out: Tensor,
    prefix_lse: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    scale: float = 1.0,
    normalize_values: bool = False,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    key_rank: int | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Extends a read ``(prefix_out, prefix_lse)`` over sources A with sources B, fused.

    Equals :func:`depth_attention` over ``A ∪ B`` with the same options; see
    :func:`attnres_kernels.reference.depth_attention_merge`.
    """
    options = check_read_options(
        eps,
        scale=scale,
        normalize_values=normalize_values,
        out_norm_eps=out_norm_eps,
        out_dtype=out_dtype,
        key_rank=key_rank,
    )
    args = check_prefix_args(
        check_depth_read(query, sources, norm_weight, out_norm_weight, options), prefix_out, prefix_lse
    )
    return _read(args, norm_weight, out_norm_weight, (prefix_out, prefix_lse), backend, return_lse, False)
