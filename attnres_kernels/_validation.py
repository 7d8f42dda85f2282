"""Input checks shared by every backend of the depth read.

All checks run in Python before any kernel is launched, so a bad call fails
with a message that names the argument instead of failing inside a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Sources = Tensor | Sequence[Tensor]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs are computed in fp64, everything else in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class DepthReadArgs:
    """A validated depth read: sources as a tuple of ``[..., D]`` tensors and
    every per-site parameter as a ``[Q, D]`` tensor (``Q = 1`` for a single
    site, with ``multi_query`` remembering whether to drop that dimension)."""

    sources: tuple
    query: Tensor
    norm_weight: Tensor | None
    out_norm_weight: Tensor | None
    multi_query: bool

    @property
    def num_queries(self) -> int:
        return self.query.shape[0]

    @property
    def lead_shape(self) -> torch.Size:
        return self.sources[0].shape[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.sources[0].dtype

    @property
    def device(self) -> torch.device:
        return self.sources[0].device

    def query_key(self) -> Tensor:
        """``u = w ⊙ γ`` in the accumulation dtype, ``[Q, D]``; folded once per
        call so a kernel needs a single dot product per source row."""
        acc = accumulation_dtype(self.dtype)
        u = self.query.to(acc)
        if self.norm_weight is not None:
            u = u * self.norm_weight.to(acc)
        return u

    def pack_outputs(self, out: Tensor, lse: Tensor, weights: Tensor | None, return_lse: bool, return_weights: bool):
        """``out`` followed by ``lse`` and ``weights`` when asked for, without the site
        dimension for a single-site read; a lone output is returned bare."""
        outputs = [out] + ([lse] if return_lse else []) + ([weights] if return_weights else [])
        if not self.multi_query:
            outputs = [o.squeeze(0) for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def out_norm_weight_acc(self) -> Tensor | None:
        """The fused output-norm weight as a contiguous ``[Q, D]`` accumulation-dtype tensor."""
        if self.out_norm_weight is None:
            return None
        acc = accumulation_dtype(self.dtype)
        return self.out_norm_weight.to(acc).expand(self.num_queries, -1).contiguous()


def _as_source_tuple(sources: Sources) -> tuple:
    if isinstance(sources, Tensor):
        if sources.dim() < 2:
            raise ValueError(
                "a stacked `sources` tensor must have shape [N, ..., D] (at least 2 dims), "
                f"got shape {tuple(sources.shape)}"
            )
        if sources.shape[0] == 0:
            raise ValueError("`sources` is empty: a depth read needs at least one source (N = 0)")
        return tuple(sources.unbind(0))
    if not isinstance(sources, (list, tuple)):
        raise TypeError(
            f"`sources` must be a tensor [N, ..., D] or a list/tuple of tensors, got {type(sources).__name__}"
        )
    if len(sources) == 0:
        raise ValueError("`sources` is empty: a depth read needs at least one source")
    for i, s in enumerate(sources):
        if not isinstance(s, Tensor):
            raise TypeError(f"sources[{i}] is a {type(s).__name__}, expected a torch.Tensor")
    return tuple(sources)


def _check_sources(sources: tuple) -> None:
    first = sources[0]
    if first.dim() < 1:
        raise ValueError("each source must have shape [..., D] with at least one dimension")
    if first.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"sources have dtype {first.dtype}; supported: float16, bfloat16, float32, float64")
    if first.shape[-1] == 0:
        raise ValueError("sources have D = 0 (an empty last dimension)")
    for i, s in enumerate(sources[1:], start=1):
        if s.dtype != first.dtype:
            raise TypeError(f"mixed source dtypes: sources[0] is {first.dtype}, sources[{i}] is {s.dtype}")
        if s.device != first.device:
            raise ValueError(f"sources on different devices: sources[0] on {first.device}, sources[{i}] on {s.device}")
        if s.shape != first.shape:
            raise ValueError(
                f"mismatched source shapes: sources[0] is {tuple(first.shape)}, sources[{i}] is {tuple(s.shape)}"
            )


def _check_param(name: str, t: Tensor, device: torch.device, d: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device} but the sources are on {device}")
    if t.dim() not in (1, 2) or t.shape[-1] != d:
        raise ValueError(f"`{name}` must have shape [D] or [Q, D] with D = {d}, got {tuple(t.shape)}")


def _per_site(name: str, t: Tensor | None, q: int, multi_query: bool, device, d: int):
    """Checks a per-site parameter and returns it as ``[Q, D]`` (or None).

    For a multi-query read a ``[D]`` tensor is shared by all Q sites; a
    single-site read takes only ``[D]``."""
    if t is None:
        return None
    _check_param(name, t, device, d)
    if t.dim() == 2:
        if not multi_query:
            raise ValueError(f"`{name}` is [Q, D] = {tuple(t.shape)} but `query` is a single [D] site")
        if t.shape[0] != q:
            raise ValueError(f"`{name}` has Q = {t.shape[0]} sites but `query` has Q = {q}")
        return t
    return t.unsqueeze(0).expand(q, d)


def check_depth_read(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None,
    out_norm_weight: Tensor | None,
    eps: float,
) -> DepthReadArgs:
    srcs = _as_source_tuple(sources)
    _check_sources(srcs)
    device, d = srcs[0].device, srcs[0].shape[-1]
    _check_param("query", query, device, d)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"`eps` must be a non-negative number, got {eps!r}")
    multi_query = query.dim() == 2
    if multi_query and query.shape[0] == 0:
        raise ValueError("`query` has Q = 0 sites")
    q2 = query if multi_query else query.unsqueeze(0)
    q = q2.shape[0]
    return DepthReadArgs(
        sources=srcs,
        query=q2,
        norm_weight=_per_site("norm_weight", norm_weight, q, multi_query, device, d),
        out_norm_weight=_per_site("out_norm_weight", out_norm_weight, q, multi_query, device, d),
        multi_query=multi_query,
    )


def check_prefix(args: DepthReadArgs, prefix_out: Tensor, prefix_lse: Tensor) -> tuple:
    """Checks the ``(h_a, lse_a)`` of a merge and returns them with a leading Q dim."""
    for name, t in (("prefix_out", prefix_out), ("prefix_lse", prefix_lse)):
        if not isinstance(t, Tensor):
            raise TypeError(f"`{name}` must be a tensor, got {type(t).__name__}")
        if t.device != args.device:
            raise ValueError(f"`{name}` is on {t.device} but the sources are on {args.device}")
    lead = tuple(args.lead_shape)
    q_dims = (args.num_queries,) if args.multi_query else ()
    want_out = q_dims + lead + (args.sources[0].shape[-1],)
    if tuple(prefix_out.shape) != want_out:
        raise ValueError(f"`prefix_out` must have shape {want_out}, got {tuple(prefix_out.shape)}")
    if prefix_out.dtype != args.dtype:
        raise TypeError(f"`prefix_out` has dtype {prefix_out.dtype} but the sources are {args.dtype}")
    if tuple(prefix_lse.shape) != q_dims + lead:
        raise ValueError(f"`prefix_lse` must have shape {q_dims + lead}, got {tuple(prefix_lse.shape)}")
    if not prefix_lse.is_floating_point():
        raise TypeError(f"`prefix_lse` must be floating point, got {prefix_lse.dtype}")
    if not args.multi_query:
        prefix_out, prefix_lse = prefix_out.unsqueeze(0), prefix_lse.unsqueeze(0)
    return prefix_out, prefix_lse.to(accumulation_dtype(args.dtype))
