"""Inkling2 (transformers ``models/inkling2``): its AttnRes reads on the fused depth read.

What the eager code computes (transformers 5.23.0, DESIGN.md §2.7): a read
``Inkling2BlockAttentionResidual(block_states [..., N, D], partial [..., D])`` stacks the N
committed blocks and the partial block, casts the stack to fp32, normalises every source with
an unweighted RMSNorm (``module.norm.eps``), and runs SDPA of the module's ``Q`` queries
(``query`` is ``[D]`` or ``[Q, D]``) against the normalised sources as keys *and* values with
scale ``1/sqrt(D)``; it returns the Q fp32 outputs as a tuple. That is one call of
:func:`attnres_kernels.depth_attention` with ``normalize_values=True``, ``scale=D**-0.5`` and
``out_dtype=torch.float32`` on the sources in place (views of ``block_states``, each read in its
own dtype), with no stacked copy, cast or SDPA buffers.

Each decoder layer passes every read's output through a weighted RMSNorm (the sublayer's
input norm, in fp32) and casts it to the model dtype; the full-attention layers read three
queries (q/k/v inputs), each with its own norm. With ``fuse_norms`` the patched layer forward
hands those norms to the same call (``out_norm_weight``, ``out_norm_eps``, ``out_dtype``), and
keeps the layer's block states as a list of views instead of concatenating a new block.

The patch swaps the class of each module instance for a subclass defined here that adds no
parameter or buffer, so state dicts, ``isinstance`` checks, hooks and ``save_pretrained`` see
the same module. It is only applied when the installed Inkling2 code is the code it was written
against (:data:`FINGERPRINTS`).
"""

from __future__ import annotations

import hashlib
import inspect

import torch
import transformers
from torch import Tensor
from transformers.models.inkling2 import modeling_inkling2 as hf_inkling2

from ..ops import BACKENDS, depth_attention
from . import TESTED_TRANSFORMERS_VERSIONS, UnsupportedTransformersError

# sha256 of `inspect.getsource(cls) + inspect.getsource(cls.forward)` for the transformers classes
# whose behaviour the patch reproduces, recorded on transformers 5.23.0. The class source pins
# the file's code; the forward source also catches a forward replaced at run time.
FINGERPRINTS = {
    "Inkling2BlockAttentionResidual": "6113f6987d19fb7ea04bb4e76db921157bb1173aed8d869ae41408c0c004fe90",
    "Inkling2UnweightedRMSNorm": "9537d3a72f10c792c5993bd1b428d60b846ea3de9ad772977a6f90f3146d10a5",
    "Inkling2RMSNorm": "fb92cc1828cb79d33a51253f41d34ff34228e154ae5ed26526a1046b295f5948",
    "Inkling2SlidingDecoderLayer": "bef9bd7cca3faa5aa904edda3aeb8e3900d59fe8c76d89459f53952b22dd764d",
    "Inkling2FullDecoderLayer": "05f1ffd9dd0a0619ca0c24d7fdaa8f4a1e83cf20dfc950a18f70b9f04b6dce31",
}
# Classes the read patch relies on; the layer classes matter only with fuse_norms.
_READ_CLASSES = ("Inkling2BlockAttentionResidual", "Inkling2UnweightedRMSNorm")
_LAYER_CLASSES = ("Inkling2RMSNorm", "Inkling2SlidingDecoderLayer", "Inkling2FullDecoderLayer")


def fingerprint(cls) -> str:
    """sha256 of the source of ``cls`` and of its ``forward`` (as :data:`FINGERPRINTS` records)."""
    try:
        text = inspect.getsource(cls) + inspect.getsource(cls.forward)
    except (OSError, TypeError) as exc:
        return f"<no source: {exc}>"
    return hashlib.sha256(text.encode()).hexdigest()


def check_transformers(check_version: bool = True, names=_READ_CLASSES + _LAYER_CLASSES) -> None:
    """Raises :class:`UnsupportedTransformersError` unless the installed transformers is a tested
    version (when ``check_version``) and its Inkling2 classes ``names`` have the recorded source."""
    if check_version and transformers.__version__ not in TESTED_TRANSFORMERS_VERSIONS:
        raise UnsupportedTransformersError(
            f"attnres_kernels.hf was tested with transformers {', '.join(TESTED_TRANSFORMERS_VERSIONS)}, "
            f"found {transformers.__version__}; install a tested version (pip install 'attnres-kernels[hf]') "
            "or pass check_version=False (the Inkling2 source is still checked)"
        )
    changed = [name for name in names if fingerprint(getattr(hf_inkling2, name, None)) != FINGERPRINTS[name]]
    if changed:
        if any(name in _READ_CLASSES for name in changed):
            advice = "the read patch does not apply either (the read module changed)"
        else:
            advice = (
                "the read patch alone still applies: apply_attnres_kernels(model, fuse_norms=False) patches the "
                "reads and leaves the decoder layers unpatched"
            )
        raise UnsupportedTransformersError(
            f"the Inkling2 code of transformers {transformers.__version__} differs from the code attnres_kernels.hf "
            f"was written against (transformers {', '.join(TESTED_TRANSFORMERS_VERSIONS)}): {', '.join(changed)} "
            f"changed; not patching (a patch of different code could compute something else); {advice}"
        )


def _read(
    module: hf_inkling2.Inkling2BlockAttentionResidual,
    sources: list,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple:
    """The read of ``module`` over ``sources`` (committed blocks, then the partial block): one output per query."""
    query = module.query if module.query.dtype == torch.float32 else module.query.float()
    out = depth_attention(
        query,
        sources,
        scale=query.shape[-1] ** -0.5,
        normalize_values=True,
        eps=module.norm.eps,
        out_norm_weight=out_norm_weight,
        out_norm_eps=out_norm_eps,
        out_dtype=out_dtype,
        backend=module.attnres_backend,
    )
    return (out,) if query.dim() == 1 else out.unbind(0)


def _read_normed(module, sources: list, norms: list, dtype: torch.dtype) -> tuple:
    """``tuple(norm(h).to(dtype) for norm, h in zip(norms, module's read of sources))``, the norms fused
    into the read when they share one eps."""
    eps = {norm.variance_epsilon for norm in norms}
    if len(eps) != 1:
        return tuple(norm(h).to(dtype) for norm, h in zip(norms, _read(module, sources)))
    weight = norms[0].weight if len(norms) == 1 else torch.stack([norm.weight for norm in norms])
    return _read(module, sources, weight, eps.pop(), dtype)


class AttnResKernelsBlockAttentionResidual(hf_inkling2.Inkling2BlockAttentionResidual):
    """``Inkling2BlockAttentionResidual`` on the fused depth read: same parameters, call and results."""

    attnres_backend = "auto"

    def forward(self, block_states: Tensor, partial_block_states: Tensor) -> tuple[Tensor, ...]:
        return _read(self, [*block_states.unbind(-2), partial_block_states])


class AttnResKernelsSlidingDecoderLayer(hf_inkling2.Inkling2SlidingDecoderLayer):
    """``Inkling2SlidingDecoderLayer`` whose reads are fused with the norms that follow them."""

    def forward(
        self,
        hidden_states: Tensor,
        block_states: Tensor,
        attention_mask: Tensor | None = None,
        conv_mask: Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> Tensor:
        dtype = hidden_states.dtype
        layer_input = hidden_states
        blocks = list(block_states.unbind(-2))
        if self.attention_input is None:
            attn_in = self.input_layernorm(layer_input).to(dtype)
        else:
            (attn_in,) = _read_normed(self.attention_input, [*blocks, layer_input], [self.input_layernorm], dtype)
        out, _ = self.self_attn(
            hidden_states=attn_in,
            attention_mask=attention_mask,
            conv_mask=conv_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        return _mlp_half(self, layer_input, blocks, out, conv_mask, past_key_values, dtype)


class AttnResKernelsFullDecoderLayer(hf_inkling2.Inkling2FullDecoderLayer):
    """``Inkling2FullDecoderLayer`` whose reads (3 queries for q/k/v, then the MLP's) are fused with their norms."""

    def forward(
        self,
        hidden_states: Tensor,
        block_states: Tensor,
        attention_mask: Tensor | None = None,
        conv_mask: Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> Tensor:
        dtype = hidden_states.dtype
        layer_input = hidden_states
        blocks = list(block_states.unbind(-2))
        norms = [self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm]
        if self.attention_input is None:
            q_in, k_in, v_in = (norm(layer_input).to(dtype) for norm in norms)
        else:
            q_in, k_in, v_in = _read_normed(self.attention_input, [*blocks, layer_input], norms, dtype)
        out, _ = self.self_attn(
            hidden_states=q_in,
            key_hidden_states=k_in,
            value_hidden_states=v_in,
            attention_mask=attention_mask,
            conv_mask=conv_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        return _mlp_half(self, layer_input, blocks, out, conv_mask, past_key_values, dtype)


def _mlp_half(layer, layer_input: Tensor, blocks: list, attn_out: Tensor, conv_mask, past_key_values, dtype):
    """The second half of both decoder layers: partial-block update, (fused) MLP read, MoE, residual."""
    partial = layer.post_attention_convolution(attn_out, past_key_values=past_key_values, conv_mask=conv_mask).float()
    if layer.is_block_boundary:  # the layer's input closes a block; the partial block restarts here
        blocks.append(layer_input)
    else:
        partial = layer_input.float() + partial
    (mlp_in,) = _read_normed(layer.mlp_input, [*blocks, partial], [layer.post_attention_layernorm], dtype)
    out = layer.post_mlp_convolution(layer.mlp(mlp_in), past_key_values=past_key_values, conv_mask=conv_mask)
    return (partial + out).to(dtype)


_PATCHED = {
    hf_inkling2.Inkling2BlockAttentionResidual: AttnResKernelsBlockAttentionResidual,
    hf_inkling2.Inkling2SlidingDecoderLayer: AttnResKernelsSlidingDecoderLayer,
    hf_inkling2.Inkling2FullDecoderLayer: AttnResKernelsFullDecoderLayer,
}


_UNPATCHED = {patched: original for original, patched in _PATCHED.items()}


def _swap(module, patched_cls) -> None:
    if type(module) is not patched_cls:
        module.__class__ = patched_cls


def apply(model: torch.nn.Module, backend: str = "auto", fuse_norms: bool = True, check_version: bool = True):
    """See :func:`attnres_kernels.hf.apply_attnres_kernels`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply_attnres_kernels expects a torch.nn.Module, got {type(model).__name__}")
    check_transformers(check_version, _READ_CLASSES + (_LAYER_CLASSES if fuse_norms else ()))

    reads, layers = [], []
    for name, module in model.named_modules():
        cls = type(module)
        if isinstance(module, hf_inkling2.Inkling2BlockAttentionResidual):
            if cls not in (hf_inkling2.Inkling2BlockAttentionResidual, AttnResKernelsBlockAttentionResidual):
                raise TypeError(
                    f"{name or 'model'} is a {cls.__qualname__}, a subclass of Inkling2BlockAttentionResidual "
                    "that attnres_kernels.hf does not know; not patching"
                )
            reads.append(module)
        elif cls in (hf_inkling2.Inkling2SlidingDecoderLayer, hf_inkling2.Inkling2FullDecoderLayer):
            layers.append(module)
        elif cls in (AttnResKernelsSlidingDecoderLayer, AttnResKernelsFullDecoderLayer) and not fuse_norms:
            module.__class__ = cls.__bases__[0]  # asked again without fusion: back to the eager layer
    if not reads:
        raise ValueError(
            f"{type(model).__name__} contains no Inkling2BlockAttentionResidual module (no Inkling2 AttnRes read "
            "to patch); apply_attnres_kernels supports Inkling2 models (transformers models/inkling2)"
        )
    for module in reads:
        _swap(module, AttnResKernelsBlockAttentionResidual)
        module.attnres_backend = backend
    if fuse_norms:
        for layer in layers:
            _swap(layer, _PATCHED[type(layer)])
    return model


def remove(model: torch.nn.Module):
    """See :func:`attnres_kernels.hf.remove_attnres_kernels`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"remove_attnres_kernels expects a torch.nn.Module, got {type(model).__name__}")
    found = False
    for module in model.modules():
        original = _UNPATCHED.get(type(module))
        if original is not None:
            module.__class__ = original
            module.__dict__.pop("attnres_backend", None)  # set by apply on each read
        found = found or isinstance(module, hf_inkling2.Inkling2BlockAttentionResidual)
    if not found:
        raise ValueError(
            f"{type(model).__name__} contains no Inkling2BlockAttentionResidual module (no Inkling2 AttnRes read); "
            "remove_attnres_kernels undoes apply_attnres_kernels on Inkling2 models"
        )
    return model
