"""One Inkling2 depth-read module (transformers' ``Inkling2BlockAttentionResidual``), patched by
``attnres_kernels.hf.apply_attnres_kernels`` vs unpatched, on CPU: forward + backward time and the
bytes autograd saves for the backward.

    python benchmarks/inkling2_read.py [--tokens 4096] [--dim 1024] [--blocks 4] [--rounds 7]

Shapes as in the issue: 4 committed blocks (bf16, one ``[B, T, 4, D]`` tensor) plus the partial sum,
T = 4096 tokens, D = 1024, Q = 1 (a sliding layer's or any MLP input) and Q = 3 (a full-attention
layer's q/k/v inputs). The partial sum is bf16 for an attention-input read (the layer's input) and
fp32 for an MLP-input read (Inkling2 adds the attention output in fp32): both are measured. Each
round runs the unpatched and the patched module back to back (interleaved); the table gives the
median and [min, max] over the rounds, the speedup of the medians, and the saved bytes (tensors
autograd keeps for backward that are not the inputs or parameters themselves, each storage counted
once). Writes ``benchmarks/results/inkling2_read.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # common.py

from attnres_kernels.hf import apply_attnres_kernels  # noqa: E402

from common import report_header  # noqa: E402


def make_module(dim: int, num_queries: int) -> torch.nn.Module:
    from transformers.models.inkling2 import modeling_inkling2 as m
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    module = m.Inkling2BlockAttentionResidual(Inkling2TextConfig(hidden_size=dim), num_queries=num_queries)
    with torch.no_grad():
        module.query.normal_(0, 1.0)
    return module


def patched_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` with the fused read (the patch works on any module containing reads)."""
    container = torch.nn.ModuleList([copy.deepcopy(module)])
    apply_attnres_kernels(container)
    return container[0]


def saved_bytes(module, blocks, partial) -> int:
    """Bytes of the tensors autograd saves for one forward that are not the inputs or parameters."""
    own = {t.untyped_storage().data_ptr() for t in (blocks, partial, *module.parameters())}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(blocks, partial)
    return total


def fwd_bwd(module, blocks, partial) -> float:
    """Seconds of one forward + backward (gradients of the inputs and the query)."""
    t = time.perf_counter()
    outs = module(blocks, partial)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    elapsed = time.perf_counter() - t
    for x in (blocks, partial, *module.parameters()):
        x.grad = None
    return elapsed


def bench(args, num_queries: int, partial_dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.tokens)
    blocks = torch.randn(*shape, args.blocks, args.dim, generator=gen).bfloat16().requires_grad_()
    partial = torch.randn(*shape, args.dim, generator=gen).to(partial_dtype).requires_grad_()
    unpatched = make_module(args.dim, num_queries)
    patched = patched_copy(unpatched)
    with torch.no_grad():  # same results (fp32 round-off) before timing
        for a, b in zip(unpatched(blocks, partial), patched(blocks, partial)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    times = {"unpatched": [], "patched": []}
    for module in (unpatched, patched):
        fwd_bwd(module, blocks, partial)  # warm-up
    for _ in range(args.rounds):
        times["unpatched"].append(fwd_bwd(unpatched, blocks, partial))
        times["patched"].append(fwd_bwd(patched, blocks, partial))
    return dict(
        queries=num_queries,
        partial=str(partial_dtype).removeprefix("torch."),
        times=times,
        saved={"unpatched": saved_bytes(unpatched, blocks, partial), "patched": saved_bytes(patched, blocks, partial)},
    )


def markdown(args, title: str, rows: list, load: tuple) -> str:
    ms = lambda ts: f"{statistics.median(ts) * 1e3:.1f} [{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]"
    mib = lambda b: f"{b / 2**20:.1f}"
    lines = [
        title,
        f"T = {args.tokens} tokens, D = {args.dim}, {args.blocks} committed "
        f"bf16 blocks + the partial sum, fp32 output; forward + backward, {args.rounds} interleaved rounds, "
        f"{torch.get_num_threads()} torch threads. "
        f"Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}.",
        "",
        "| Q | partial | unpatched ms, median [min, max] | patched ms | speedup "
        "| saved MiB unpatched | patched | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, s = r["times"], r["saved"]
        speedup = statistics.median(t["unpatched"]) / statistics.median(t["patched"])
        lines.append(
            f"| {r['queries']} | {r['partial']} | {ms(t['unpatched'])} | {ms(t['patched'])} | {speedup:.2f}x | "
            f"{mib(s['unpatched'])} | {mib(s['patched'])} | {s['patched'] / s['unpatched']:.3f} |"
        )
    lines += [
        "",
        "Unpatched, transformers concatenates the blocks with the partial sum, upcasts the stack to fp32, "
        "materialises its normalised copy and runs `scaled_dot_product_attention` over it, saving those "
        "copies for the backward. Patched, the fused read takes the per-block views and the partial sum in "
        "place and saves only per-row scalars (logits and key-norm scales) besides references to its inputs.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "inkling2_read.md"))
    args = parser.parse_args(argv)
    title = report_header("One Inkling2 read module, patched vs unpatched (CPU)", argv)
    load_before = os.getloadavg()[0]
    rows = [bench(args, q, dt) for q in (1, 3) for dt in (torch.bfloat16, torch.float32)]
    report = markdown(args, title, rows, (load_before, os.getloadavg()[0]))
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
