"""Optional integration with Hugging Face transformers (``pip install attnres-kernels[hf]``).

:func:`apply_attnres_kernels` patches, in place, the Attention-Residual reads of a
transformers model (Inkling2: ``Inkling2ForCausalLM``, ``Inkling2ForConditionalGeneration``,
``Inkling2TextModel`` or any module containing ``Inkling2BlockAttentionResidual`` modules)
to run the fused depth read of :func:`attnres_kernels.depth_attention`, weights untouched;
:func:`remove_attnres_kernels` undoes it.

Importing this subpackage does not import transformers; the first call does.
"""

from __future__ import annotations

__all__ = [
    "TESTED_TRANSFORMERS_VERSIONS",
    "UnsupportedTransformersError",
    "apply_attnres_kernels",
    "remove_attnres_kernels",
]

# The transformers releases whose Inkling2 code the patch was written and tested against.
TESTED_TRANSFORMERS_VERSIONS = ("5.23.0",)


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers (its version, or its Inkling2 code) is not the one the patch was written against."""


def apply_attnres_kernels(model, backend: str = "auto", *, fuse_norms: bool = True, check_version: bool = True):
    """Runs every Inkling2 AttnRes read of ``model`` on the fused depth read, in place; returns ``model``.

    - Each ``Inkling2BlockAttentionResidual`` keeps its parameters, buffers, names and call
      signature ``(block_states, partial_block_states) -> tuple`` (one output per query) and
      returns the same results up to fp32 round-off: the read goes through
      :func:`attnres_kernels.depth_attention` (``normalize_values=True``, scale ``1/sqrt(D)``,
      fp32 output) on the block states in place, without the stack, cast and SDPA of the eager code.
    - ``fuse_norms=True`` also patches the decoder layers' forward so each read is fused with the
      RMSNorm that follows it (the sublayer's input norm, output in the model dtype) and the
      layer's own boundary ``torch.cat`` of block states becomes a list of views.
    - ``backend``: as for :func:`attnres_kernels.depth_attention` (``"auto"``, ``"cpu"``,
      ``"triton"``, ``"cuda"``, ``"reference"``). Calling again changes the backend.

    The state dict is untouched (``save_pretrained`` / ``from_pretrained`` work as before). Raises
    ``ValueError`` when ``model`` contains no Inkling2 AttnRes module, and
    :class:`UnsupportedTransformersError` when the installed transformers is not one of
    :data:`TESTED_TRANSFORMERS_VERSIONS` (``check_version=False`` skips that check) or when its
    Inkling2 code differs from the code the patch was written against (always checked; when only
    the decoder layers differ, the message says so and ``fuse_norms=False`` patches the reads).
    """
    return _inkling2().apply(model, backend=backend, fuse_norms=fuse_norms, check_version=check_version)


def remove_attnres_kernels(model):
    """Undoes :func:`apply_attnres_kernels` in place; returns ``model``.

    Every patched module is again an instance of its transformers class (the read module, the
    decoder layers), with the same parameters, buffers and hooks, so the model computes what
    the unpatched model does. A model that was never patched is returned as it is. Raises
    ``ValueError`` when ``model`` contains no Inkling2 AttnRes module.
    """
    return _inkling2().remove(model)


def _inkling2():
    try:
        from . import inkling2
    except ImportError as exc:  # transformers missing, or too old to have Inkling2
        raise ImportError(
            "attnres_kernels.hf needs transformers with Inkling2: pip install 'attnres-kernels[hf]' "
            f"(tested with transformers {', '.join(TESTED_TRANSFORMERS_VERSIONS)}); import failed: {exc}"
        ) from exc
    return inkling2
