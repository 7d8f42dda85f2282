"""The host side of the CUDA depth read and Block step, run through the SIMT harness build of the very
same torch-side code (csrc/cuda/depth_attention_ops.h, block_step_ops.h): per call it allocates the
outputs (and the backward's one workspace of partial sums) and launches, nothing else. No ATen
arithmetic on the site parameters (the kernels form u = scale · query ⊙ norm_weight and write the
parameters' gradients), no zero fills, no copies (the source table travels in the kernel parameters:
no pinned staging, no host-to-device copy), no host synchronisation, and every allocation's size
follows from the shapes alone: what a CUDA graph capture needs."""

import pytest
import torch

from attnres_kernels._validation import ReadOptions

# What the ops may call besides launching: allocations, and the [M, D] row views the shared checks make.
ALLOWED = {"aten::empty", "aten::reshape", "aten::view"}


pytestmark = pytest.mark.usefixtures("cuda_emulation")


def _calls_inside(fn, op_prefix="attnres_emu::"):
    """(name, bytes allocated) of every ATen call the attnres_emu ops made while ``fn`` ran, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    calls = []

    def walk(event):
        for child in event.cpu_children:
            calls.append((child.name, child.cpu_memory_usage))
            walk(child)

    ops = [e for e in prof.events() if e.name.startswith(op_prefix)]
    assert ops, "no attnres_emu op ran"
    for e in ops:
        calls.append((e.name, None))
        walk(e)
    return calls


def _depth_call(n, lead, d, q, rank, weighted, fill):
    """A forward and a backward of the emulated depth read with a merge prefix and the output norm;
    ``fill`` sets the data (the shapes stay)."""
    op = torch.ops.attnres_emu
    r = rank or d
    sources = [fill(torch.empty(*lead, d)) for _ in range(n)]
    query, gamma = fill(torch.empty(q, r)), fill(torch.empty(r))
    g = fill(torch.empty(d))
    h_a, lse_a = fill(torch.empty(q, *lead, d)), fill(torch.empty(q, *lead))
    options = ReadOptions(1e-6, 1e-6, 0.5, weighted, None, rank)

    def call():
        out, lse, logits, rinv = op.depth_attn_fwd(sources, query, gamma, h_a, lse_a, g, *options)
        op.depth_attn_bwd(fill(torch.empty_like(out)), lse, None, sources, query, gamma, h_a, lse_a, g, logits, rinv,
                          *options)  # fmt: skip

    return call


def _step_call(lead, d, rank, fill):
    op = torch.ops.attnres_emu
    r = rank or d
    partial, update, h_a = (fill(torch.empty(*lead, d)) for _ in range(3))
    query, gamma, g, lse_a = fill(torch.empty(r)), fill(torch.empty(r)), fill(torch.empty(d)), fill(torch.empty(lead))

    def call():
        new, out, lse, logit, rinv = op.block_step_fwd(partial, update, query, gamma, h_a, lse_a, g, 1e-6, rank)
        op.block_step_bwd(fill(torch.empty_like(new)), fill(torch.empty_like(out)), lse, new, query, gamma, h_a, lse_a,
                          g, logit, rinv, 1e-6, rank)  # fmt: skip

    return call


FILLS = {
    "normal": lambda t: t.normal_(),
    "large": lambda t: t.normal_().mul_(1e4),
    "special": lambda t: t.normal_().index_fill_(-1, torch.tensor([0]), float("nan")),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize(
    "case",
    [
        dict(n=3, lead=(4, 5), d=16, q=2, rank=None, weighted=False),
        dict(n=4, lead=(3,), d=37, q=3, rank=9, weighted=False),  # sliced low-rank keys
        dict(n=2, lead=(2, 3), d=24, q=1, rank=None, weighted=True),  # normalised values with a key-norm weight
    ],
)
def test_depth_read_allocates_by_shape_and_calls_nothing_else(case):
    runs = [_calls_inside(_depth_call(**case, fill=fill)) for fill in FILLS.values()]
    names = {name for name, _ in runs[0] if not name.startswith("attnres_emu::")}
    assert names <= ALLOWED, names - ALLOWED
    assert runs[1] == runs[0] and runs[2] == runs[0], "an allocation depends on the data"
    # Forward: out, lse, logits, rinv. Backward: N source gradients, the three parameter gradients,
    # the prefix's two, and one workspace of partial sums.
    n = case["n"]
    bwd = runs[0].index(("attnres_emu::depth_attn_bwd", None))
    assert [name for name, _ in runs[0][:bwd]].count("aten::empty") == 4
    assert [name for name, _ in runs[0][bwd:]].count("aten::empty") == n + 3 + 2 + 1


def test_block_step_allocates_by_shape_and_calls_nothing_else():
    runs = [_calls_inside(_step_call((3, 4), 20, rank, FILLS["normal"])) for rank in (None, None, 5)]
    for calls in runs:
        names = {name for name, _ in calls if not name.startswith("attnres_emu::")}
        assert names <= ALLOWED, names - ALLOWED
    assert runs[1] == runs[0]
    # new_partial, out, lse, logit, rinv; then the total gradient, d query, d norm_weight, d h_a, d lse_a,
    # d out_norm_weight and the partial sums (no zero fill: the kernels write every element).
    bwd = runs[0].index(("attnres_emu::block_step_bwd", None))
    assert [name for name, _ in runs[0][:bwd]].count("aten::empty") == 5
    assert [name for name, _ in runs[0][bwd:]].count("aten::empty") == 7
