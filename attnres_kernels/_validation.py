"""Input checks shared by every backend of every op family.

All checks run in Python before any kernel is launched, so a bad call fails
with a message that names the argument instead of failing inside a kernel.

Mixed precision (DESIGN.md §2.5): the sources of one depth read may have
different floating dtypes (under ``torch.autocast`` the embedding stays fp32
while sublayer outputs are bf16/fp16). The read then returns the PyTorch
promotion of the source dtypes (and of the merge prefix), accumulates in fp32
(fp64 when that promotion is fp64) and gives each source its gradient in its
own dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Largest attention head size of the fused attention kernels (C++ CPU, Triton, CUDA): they keep
# a [tile, Dh] block of q, k, v per program. Here, at the bottom, so that kernels and ops both read it.
MAX_HEAD_DIM = 256


class ReadOptions(NamedTuple):
    """The options of one depth read (DESIGN.md §2.7), one object from validation to
    every backend. Its fields, in order, are the trailing scalars of the
    ``depth_attn_fwd`` / ``depth_attn_bwd`` op schemas (mirrored by the C++ struct
    ``attnres::ReadOptions`` in ``csrc/depth_attention.h``), so a backend op is
    called with ``*options``. Build one with :func:`check_read_options`.

    - ``eps``: epsilon of the key RMSNorm ``r_i = rsqrt(mean(v_i²) + eps)``;
    - ``out_norm_eps``: epsilon of the fused output RMSNorm;
    - ``scale``: multiplies the logits, in the accumulation dtype (paper: 1;
      Inkling2: ``1/√D``);
    - ``normalize_values``: the values are the normalised sources
      ``r_i v_i`` (times the key-norm weight when one is given; Inkling2)
      instead of the raw ``v_i`` (paper);
    - ``out_dtype``: the output dtype, or None for the promotion of the sources'
      (and a merge prefix's) dtypes;
    - ``key_rank``: sliced low-rank keys (LR-AttnRes): the key of each source is its
      last R coordinates, RMS-normalised over those R, so ``query`` and ``norm_weight``
      have R entries while values and output keep the full width D. None is the
      ordinary read (R = D; :func:`check_depth_read` turns ``key_rank = D`` into None).
    """

    eps: float = 1e-6
    out_norm_eps: float = 1e-6
    scale: float = 1.0
    normalize_values: bool = False
    out_dtype: torch.dtype | None = None
    key_rank: int | None = None


PAPER_READ = ReadOptions()

# The ReadOptions fields as the trailing arguments of an op schema (the C++ side's
# ATTNRES_READ_OPTIONS_SCHEMA; the Triton ops define their schemas with it).
READ_OPTIONS_SCHEMA = (
    "float eps, float out_norm_eps, float scale, bool normalize_values, ScalarType? out_dtype, int? key_rank"
)


def check_read_options(
    eps: float = 1e-6,
    *,
    scale: float = 1.0,
    normalize_values: bool = False,
    out_norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    key_rank: int | None = None,
) -> ReadOptions:
    """The :class:`ReadOptions` of a read, checked; ``out_norm_eps`` defaults to ``eps``.
    ``key_rank`` is checked against the width D by :func:`check_depth_read`."""
    if (
        eps == 1e-6
        and scale == 1.0
        and normalize_values is False
        and out_norm_eps is None
        and out_dtype is None
        and key_rank is None
        and type(eps) is float
        and type(scale) is float
    ):
        return PAPER_READ  # the defaults: the paper's read, on every call of the models' sites
    for name, value in (("eps", eps), ("out_norm_eps", out_norm_eps)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"`{name}` must be a non-negative number, got {value!r}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)):
        raise ValueError(f"`scale` must be a finite number, got {scale!r}")
    if not isinstance(normalize_values, bool):
        raise TypeError(f"`normalize_values` must be a bool, got {type(normalize_values).__name__}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`out_dtype` must be one of float16, bfloat16, float32, float64 or None, got {out_dtype!r}")
    if key_rank is not None and not (isinstance(key_rank, int) and not isinstance(key_rank, bool) and key_rank >= 1):
        raise ValueError(f"`key_rank` must be a positive int or None, got {key_rank!r}")
    return ReadOptions(
        float(eps),
        float(eps if out_norm_eps is None else out_norm_eps),
        float(scale),
        normalize_values,
        out_dtype,
        None if key_rank is None else int(key_rank),
    )


Sources = Tensor | Sequence[Tensor]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs are computed in fp64, everything else in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def promoted_dtype(tensors) -> torch.dtype:
    """PyTorch type promotion over the dtypes of ``tensors`` (Nones skipped)."""
    dtype = None
    for t in tensors:
        if t is not None and t.dtype is not dtype:  # dtypes are singletons: the usual equal ones skip the promotion
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


@dataclass
class DepthReadArgs:
    """A validated depth read: sources as a tuple of ``[..., D]`` tensors and the
    per-site parameters as given (``site_query`` is ``[D]`` for one site or
    ``[Q, D]``; the weights ``[D]`` or ``[Q, D]``).

    ``query``, ``norm_weight`` and ``out_norm_weight`` are the same parameters
    as ``[Q, D]`` tensors (``Q = 1`` for a single site, with ``multi_query``
    remembering whether to drop that dimension), built when asked for: the fused
    backends take the parameters as given and never pay for those views."""

    sources: tuple
    site_query: Tensor
    site_norm_weight: Tensor | None
    site_out_norm_weight: Tensor | None
    options: ReadOptions = PAPER_READ
    prefix_dtype: torch.dtype | None = None  # dtype of a merge prefix h_a; takes part in the promotion

    @property
    def multi_query(self) -> bool:
        return self.site_query.dim() == 2

    @property
    def num_queries(self) -> int:
        return self.site_query.shape[0] if self.multi_query else 1

    def _per_site(self, t: Tensor | None) -> Tensor | None:
        if t is None or t.dim() == 2:
            return t
        return t.unsqueeze(0).expand(self.num_queries, -1)

    @property
    def query(self) -> Tensor:
        return self._per_site(self.site_query)

    @property
    def norm_weight(self) -> Tensor | None:
        return self._per_site(self.site_norm_weight)

    @property
    def out_norm_weight(self) -> Tensor | None:
        return self._per_site(self.site_out_norm_weight)

    @property
    def lead_shape(self) -> torch.Size:
        return self.sources[0].shape[:-1]

    @property
    def key_dim(self) -> int:
        """R: the width of the keys, ``query`` and ``norm_weight`` (D unless ``key_rank`` is set)."""
        return self.options.key_rank or self.sources[0].shape[-1]

    @property
    def input_dtype(self) -> torch.dtype:
        """The promotion of the source dtypes (and of a merge prefix)."""
        dtype = promoted_dtype(self.sources)
        return dtype if self.prefix_dtype is None else torch.promote_types(dtype, self.prefix_dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The output dtype: ``options.out_dtype`` when given, else :attr:`input_dtype`."""
        return self.options.out_dtype or self.input_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The promotion of the inputs and the output (the sources promoted once)."""
        input_dtype, out_dtype = self.input_dtype, self.options.out_dtype
        return input_dtype if out_dtype is None else torch.promote_types(input_dtype, out_dtype)

    @property
    def acc_dtype(self) -> torch.dtype:
        """The accumulation dtype: fp64 when the inputs or the output are fp64, else fp32."""
        return accumulation_dtype(self.compute_dtype)

    @property
    def device(self) -> torch.device:
        return self.sources[0].device

    def query_key(self) -> Tensor:
        """``u = scale · w ⊙ γ`` in the accumulation dtype, ``[Q, D]``; folded once per
        call so a kernel needs a single dot product per source row."""
        acc = self.acc_dtype
        u = self.query.to(acc)
        if self.norm_weight is not None:
            u = u * self.norm_weight.to(acc)
        return u if self.options.scale == 1.0 else u * self.options.scale

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
        return self.out_norm_weight.to(self.acc_dtype).expand(self.num_queries, -1).contiguous()


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
    shape, device = first.shape, first.device
    if len(shape) < 1:
        raise ValueError("each source must have shape [..., D] with at least one dimension")
    if shape[-1] == 0:
        raise ValueError("sources have D = 0 (an empty last dimension)")
    for i, s in enumerate(sources):  # one pass: these checks run on every call
        if s.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"sources[{i}] has dtype {s.dtype}; supported: float16, bfloat16, float32, float64")
        if s.device != device:
            raise ValueError(f"sources on different devices: sources[0] on {device}, sources[{i}] on {s.device}")
        if s.shape != shape:
            raise ValueError(
                f"mismatched source shapes: sources[0] is {tuple(shape)}, sources[{i}] is {tuple(s.shape)}"
            )


def _check_param(name: str, t: Tensor, device: torch.device, d: int, width: str = "D") -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device} but the sources are on {device}")
    if t.dim() not in (1, 2) or t.shape[-1] != d:
        raise ValueError(f"`{name}` must have shape [{width}] or [Q, {width}] with {width} = {d}, got {tuple(t.shape)}")


def _check_per_site(name: str, t: Tensor | None, q: int, multi_query: bool, device, d: int, width: str = "D") -> None:
    """Checks a per-site parameter: ``[D]`` (shared by the Q sites of a multi-query
    read), or ``[Q, D]`` for a multi-query read only (``[R]`` / ``[Q, R]`` for the key's
    parameters of a low-rank read)."""
    if t is None:
        return
    _check_param(name, t, device, d, width)
    if t.dim() == 2:
        if not multi_query:
            raise ValueError(f"`{name}` is [Q, D] = {tuple(t.shape)} but `query` is a single [D] site")
        if t.shape[0] != q:
            raise ValueError(f"`{name}` has Q = {t.shape[0]} sites but `query` has Q = {q}")


def check_depth_read(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None,
    out_norm_weight: Tensor | None,
    options: ReadOptions = PAPER_READ,
) -> DepthReadArgs:
    """Checks a read's tensors (its ``options`` come checked from :func:`check_read_options`).
    A ``key_rank`` equal to D becomes None (the ordinary read)."""
    srcs = _as_source_tuple(sources)
    _check_sources(srcs)
    device, d = srcs[0].device, srcs[0].shape[-1]
    key_dim, key_width = d, "D"
    if options.key_rank is not None:
        if options.key_rank > d:
            raise ValueError(f"`key_rank` must be at most the sources' width D = {d}, got {options.key_rank}")
        if options.key_rank == d:
            options = options._replace(key_rank=None)
        else:
            if options.normalize_values:
                raise ValueError(
                    "`normalize_values` needs full-width keys: the values would be normalised over the "
                    f"last key_rank = {options.key_rank} of D = {d} coordinates; use key_rank=None"
                )
            key_dim, key_width = options.key_rank, "R"
    _check_param("query", query, device, key_dim, key_width)
    multi_query = query.dim() == 2
    q = query.shape[0] if multi_query else 1
    if q == 0:
        raise ValueError("`query` has Q = 0 sites")
    _check_per_site("norm_weight", norm_weight, q, multi_query, device, key_dim, key_width)
    _check_per_site("out_norm_weight", out_norm_weight, q, multi_query, device, d)
    return DepthReadArgs(srcs, query, norm_weight, out_norm_weight, options)


def check_prefix_args(args: DepthReadArgs, prefix_out: Tensor, prefix_lse: Tensor) -> DepthReadArgs:
    """Checks the ``(h_a, lse_a)`` of a merge; returns the read's arguments with the
    prefix's dtype in the promotion."""
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
    if prefix_out.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`prefix_out` has dtype {prefix_out.dtype}; supported: float16, bfloat16, float32, float64")
    if tuple(prefix_lse.shape) != q_dims + lead:
        raise ValueError(f"`prefix_lse` must have shape {q_dims + lead}, got {tuple(prefix_lse.shape)}")
    if not prefix_lse.is_floating_point():
        raise TypeError(f"`prefix_lse` must be floating point, got {prefix_lse.dtype}")
    return dataclasses.replace(args, prefix_dtype=prefix_out.dtype)


def check_prefix(args: DepthReadArgs, prefix_out: Tensor, prefix_lse: Tensor) -> tuple:
    """:func:`check_prefix_args`, and the prefix with a leading Q dim (``lse_a`` in
    the accumulation dtype)."""
    args = check_prefix_args(args, prefix_out, prefix_lse)
    if not args.multi_query:
        prefix_out, prefix_lse = prefix_out.unsqueeze(0), prefix_lse.unsqueeze(0)
    return args, (prefix_out, prefix_lse.to(args.acc_dtype))


def check_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float | None) -> float:
    """Checks the arguments of an attention call (DESIGN.md §2.4); returns the scale.

    The common case is one pass of cheap comparisons, each tensor property read once;
    the messages come from the slower look at what failed. (Plain CPU tensors skip it:
    the C++ op checks them itself, and this runs only to word the error of a call the
    op rejected.)"""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"`{name}` must be a tensor, got {type(t).__name__}")
    q_shape, k_shape = q.shape, k.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or v.dim() != 4:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"`{name}` must be 4-D [B, heads, T, Dh], got shape {tuple(t.shape)}")
    dtype, device = q.dtype, q.device
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`q` has dtype {dtype}; supported: float16, bfloat16, float32, float64")
    if k.dtype is not dtype or v.dtype is not dtype or k.device != device or v.device != device:
        for name, t in (("k", k), ("v", v)):
            if t.dtype != dtype:
                raise TypeError(f"`{name}` has dtype {t.dtype} but `q` is {dtype}")
            if t.device != device:
                raise ValueError(f"`{name}` is on {t.device} but `q` is on {device}")
    if k_shape != v.shape:
        raise ValueError(f"`k` and `v` must have one shape [B, Hkv, Tk, Dh], got {tuple(k_shape)}, {tuple(v.shape)}")
    b, h, _, dh = q_shape
    kb, hkv, tk, k_dh = k_shape
    if kb != b or k_dh != dh:
        raise ValueError(f"`k`/`v` {tuple(k_shape)} do not match `q` {tuple(q_shape)} in batch size or head size")
    if dh == 0:
        raise ValueError("head size Dh = 0")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads H = {h} must be a multiple of key/value heads Hkv = {hkv}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("`key_padding_mask` must be a bool tensor [B, Tk] (True = a real key)")
        if tuple(key_padding_mask.shape) != (b, tk):
            raise ValueError(
                f"`key_padding_mask` must have shape [B, Tk] = {(b, tk)}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != device:
            raise ValueError(f"`key_padding_mask` is on {key_padding_mask.device} but `q` is on {device}")
    if scale is None:
        return dh**-0.5
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"`scale` must be a positive finite number, got {scale!r}")
    return float(scale)


def check_block_step(partial: Tensor | None, update: Tensor) -> None:
    """Checks the two addends of a Block residual step (the read itself is checked as a merge)."""
    if not isinstance(update, Tensor):
        raise TypeError(f"`update` must be a tensor, got {type(update).__name__}")
    if update.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`update` has dtype {update.dtype}; supported: float16, bfloat16, float32, float64")
    if partial is None:
        return
    if not isinstance(partial, Tensor):
        raise TypeError(f"`partial` must be a tensor or None, got {type(partial).__name__}")
    if partial.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`partial` has dtype {partial.dtype}; supported: float16, bfloat16, float32, float64")
    if partial.shape != update.shape:
        raise ValueError(f"`partial` {tuple(partial.shape)} and `update` {tuple(update.shape)} differ in shape")
    if partial.device != update.device:
        raise ValueError(f"`partial` is on {partial.device} but `update` is on {update.device}")
