"""The Triton kernels as torch.library custom ops: ``attnres_triton::depth_attn_{fwd,bwd}``
(depth read), ``attnres_triton::attn_{fwd,bwd}`` (attention) and
``attnres_triton::block_step_{fwd,bwd}`` (the fused Block step).

They take the same schemas as the C++ ops and run on whatever device the Triton
launch targets: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Their
fake kernels and autograd are the op layer's business
(:func:`attnres_kernels.ops._dispatch.triton_ops` registers them): kernels do not
import the layer above them.
"""

from __future__ import annotations

import torch

from .._validation import READ_OPTIONS_SCHEMA
from . import attention_ops, block_step_ops, depth_attention_ops

FWD_SCHEMA = (
    "(Tensor[] sources, Tensor query, Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, "
    f"Tensor? out_norm_weight, {READ_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)"
)
BWD_SCHEMA = (
    "(Tensor grad_out, Tensor? grad_lse, Tensor? grad_logits, Tensor[] sources, Tensor query, Tensor? norm_weight, "
    "Tensor? prefix_out, Tensor? prefix_lse, Tensor? out_norm_weight, Tensor logits, Tensor rinv, "
    f"{READ_OPTIONS_SCHEMA}) -> (Tensor[], Tensor, Tensor, Tensor, Tensor, Tensor)"
)
ATTN_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float scale) -> (Tensor out, Tensor lse)"
)
ATTN_BWD_SCHEMA = (
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor out, "
    "Tensor lse, bool causal, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)"
)

_lib = torch.library.Library("attnres_triton", "DEF")
_lib.define("depth_attn_fwd" + FWD_SCHEMA)
_lib.define("depth_attn_bwd" + BWD_SCHEMA)
_lib.define("attn_fwd" + ATTN_FWD_SCHEMA)
_lib.define("attn_bwd" + ATTN_BWD_SCHEMA)
_lib.define("block_step_fwd" + block_step_ops.FWD_SCHEMA)
_lib.define("block_step_bwd" + block_step_ops.BWD_SCHEMA)
for _device in ("CPU", "CUDA"):
    _lib.impl("depth_attn_fwd", depth_attention_ops.depth_attn_fwd, _device)
    _lib.impl("depth_attn_bwd", depth_attention_ops.depth_attn_bwd, _device)
    _lib.impl("attn_fwd", attention_ops.attn_fwd, _device)
    _lib.impl("attn_bwd", attention_ops.attn_bwd, _device)
    _lib.impl("block_step_fwd", block_step_ops.block_step_fwd, _device)
    _lib.impl("block_step_bwd", block_step_ops.block_step_bwd, _device)
