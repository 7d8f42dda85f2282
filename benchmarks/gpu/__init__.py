"""GPU benchmark of the depth read, attention, the Block step and training steps; writes Markdown and JSON.

    python -m benchmarks.gpu [--out benchmarks/results] [--quick] [--rep 100] [--skip-models] [--sections ...]
    python -m benchmarks.gpu --dry-run [--out DIR]    # no GPU: exercises the same code on tiny CPU tensors
    make gpu-bench                                     # pytest -m cuda, then this command

One module per section of the report: :mod:`.reads` (the depth read), :mod:`.ops` (attention and the
Block step), :mod:`.host` (host cost of a read), :mod:`.models` (training steps), :mod:`.inkling2`;
:mod:`.environment` (timer, host/device split), :mod:`.report` (Markdown), :mod:`.cli` (the command).

Depth read (DESIGN.md §2.1, §6): forward and forward+backward timed with
``triton.testing.do_bench`` (median and 20/80 % quantiles, L2 flushed before each run) for

- ours: the Triton backend and the CUDA backend;
- baselines: the eager reference and ``torch.compile`` of it (Inductor), and a device-to-device
  copy into a reused buffer of as many bytes as the forward's I/O floor (the bandwidth reference);
- peers, when their package is installed (see :data:`PEERS` for how each API is called):
  fla-core's ``fla.ops.attnres.fused_attnres``, liger-kernel's ``LigerAttnResFunction``,
  fast-attnres's ``attnres``, and flash-attn-res's phase-1 op (multi-query).

Every timed implementation is first checked for accuracy in the same run: its output and
gradients against an fp32 oracle (the reference on fp32 copies of the inputs), with
FlashAttention's rule (error at most 3x that of the eager reference in the input precision, plus
a small slack); a failing implementation is marked FAIL in the report. An implementation that
is not installed or cannot run a case (no CUDA build of ours yet, a peer's width or dtype limits)
is listed as skipped with the reason, never as an error; one that raises is listed as an error.

Host vs device (:meth:`Env.split`): for every timed op, the host's cost to issue one call (µs,
calls not synchronized) and the time of its kernels (``torch.profiler``, CUDA activity), and
which of the two bounds it; the same per training step. A call whose host cost exceeds its
kernels' time is host-bound: do_bench then times the Python call path, not the kernels.

Attention: causal ``ak.attention`` on the Triton and CUDA backends against PyTorch's
``scaled_dot_product_attention`` (B = 4, H = 16, T = 2048, Dh = 64 and 128, bf16), checked by
the same rule (the same-precision baseline is plain PyTorch attention in bf16, FlashAttention's).

Host cost (:func:`bench_host`): where the host's time goes in one depth read on each fused backend (the
public function, ``read_unchecked``, the raw ops, Triton's own launch of each kernel) beside plain PyTorch
calls for scale, the autograd engine's cost for as many leaves among them.

Block step: ``ak.block_step`` (``partial + update`` and the next site's merge read with its
PreNorm, M = 4 x 2048 rows, D = 1024, bf16, prefix from a read over 4 blocks) on the Triton and
CUDA backends and the eager reference, outputs and every input gradient checked.

Inkling2: one transformers ``Inkling2BlockAttentionResidual`` (Q = 1 and 3) unpatched and patched by
``attnres_kernels.hf.apply_attnres_kernels``, forward + backward time and saved bytes; and an AdamW
training step of a random bf16 ``Inkling2ForCausalLM`` (``benchmarks/inkling2_model.py``'s model,
sized up) unpatched, with its reads patched, and with reads and norms fused, with peak memory.

Models: one AdamW training step (bf16 autocast: fp32 parameters and embedding, bf16 sublayers,
so the depth reads see mixed dtypes) of Standard, Full and Block AttnRes at d=1024, L=12,
T=1024 on the fused kernels (``backend="auto"``) and on the reference depth read, with the peak
memory of the step and its device time (profiler over 2 steps); on a GPU also Standard, Full and
Block with their forward and backward replayed from CUDA graphs (``torch.cuda.make_graphed_callables``).

``--dry-run`` runs the same code paths on tiny CPU tensors: Triton under its interpreter
(``TRITON_INTERPRET=1``), a ``perf_counter`` timer instead of ``do_bench``, ``torch.compile``
with the ``aot_eager`` backend, the C++ CPU kernels in the models. Its numbers mean nothing; it
exists so that ``tests/benchmarks/test_gpu_benchmark_script.py`` can check the script's logic without a GPU.
Without ``--out`` a dry run prints its report and writes no file.
"""

import os
import sys

# --dry-run needs the interpreter chosen before Triton kernels are first imported.
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .cli import main

__all__ = ["main"]
