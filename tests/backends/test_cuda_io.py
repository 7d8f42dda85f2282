"""The I/O floor of the CUDA depth-read kernels, counted by the SIMT harness.

Every global-memory access of a launch is attributed to the buffer it touches
(anything else is "untracked", which must stay 0). The forward must read each
source element once and write each output element once, plus O(N) per-row
scalars; the backward must move what the kernel header's formula claims
(csrc/cuda/depth_attention_kernels.cuh): two reads of the sources, one write of
their gradients, the site parameters once per team, one du (dg) partial per row
chunk. Scalars every lane of a warp loads from one address count once per warp
(W warps per row team), as a GPU serves them with one request.
"""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.cuda import emulation
from tests.support import site_params

ROW_REF = 32  # bytes of one source-table entry


pytestmark = pytest.mark.usefixtures("cuda_emulation")


def nbytes(t):
    return t.numel() * t.element_size()


def run_read(sources, q, out_norm, prefix_dtype=None, normalize_values=False):
    """One forward + backward through backend="cuda"; returns the launch records and the tensors.
    ``normalize_values``: Inkling2's read (normalised values, no key-norm weight)."""
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    w, g, g_out = site_params(q, d)
    if normalize_values:
        g = None
    srcs = [s.clone().requires_grad_() for s in sources]
    kwargs = dict(out_norm_weight=g_out if out_norm else None, return_lse=True, backend="cuda")
    if normalize_values:
        kwargs.update(normalize_values=True, scale=d**-0.5)
    prefix = None
    if prefix_dtype is not None:
        h_a, lse_a = reference.depth_attention(
            w, [torch.randn(*lead, d) for _ in range(2)], g, return_lse=True, normalize_values=normalize_values
        )
        prefix = (h_a.to(prefix_dtype), lse_a)
        out, lse = ak.depth_attention_merge(w, *prefix, srcs, g, **kwargs)
    else:
        out, lse = ak.depth_attention(w, srcs, g, **kwargs)
    fwd_launches = emulation.launch_log()
    (out.double().sum() + lse.sum()).backward()
    bwd_launches = emulation.launch_log()
    return fwd_launches, bwd_launches, out, prefix


def warps(launch):
    return launch.block[0] // 32


def teams(launch):
    return launch.grid[0] * launch.grid[1] * launch.block[1]


@pytest.mark.parametrize(
    "dtypes,d,q,out_norm,prefix_dtype",
    [
        ((torch.float32, torch.bfloat16, torch.float16), 64, None, True, torch.bfloat16),  # vector path, merge
        ((torch.float32,) * 4, 100, 3, False, None),  # several sites in one tile
        ((torch.bfloat16, torch.float32), 37, None, True, None),  # unaligned rows: element loads
        ((torch.float64, torch.float32), 640, 2, True, torch.float64),  # 32 warps per row
    ],
)
@pytest.mark.parametrize("normalize_values", [False, True], ids=["raw-values", "normalised-values"])
def test_forward_reads_each_source_once_and_writes_each_output_once(
    dtypes, d, q, out_norm, prefix_dtype, normalize_values
):
    m, n = 12, len(dtypes)
    sources = [torch.randn(3, 4, d).to(dt) for dt in dtypes]
    (fwd,), _, out, prefix = run_read(sources, q, out_norm, prefix_dtype, normalize_values)
    nq = 1 if q is None else q
    acc = 8 if out.dtype == torch.float64 else 4
    w = warps(fwd)
    assert fwd.grid[1] == 1, "one site tile: the sources are read once for all sites"
    expected_reads = {
        "sources": sum(nbytes(s) for s in sources),  # each source element once
        "table": m * n * ROW_REF * w,
        "u": teams(fwd) * nq * d * acc,  # staged once per row team
        "g": teams(fwd) * nq * d * acc if out_norm else 0,
        "prefix_out": nbytes(prefix[0]) if prefix else 0,
        "prefix_lse": nq * m * acc * w if prefix else 0,
    }
    expected_writes = {
        "out": nbytes(out),  # each output element once
        "lse": nq * m * acc,
        "logits": nq * n * m * acc,
        "rinv": n * m * acc,
    }
    for group, (read, written) in fwd.traffic.items():
        assert read == expected_reads.get(group, 0), (group, read, expected_reads.get(group, 0))
        assert written == expected_writes.get(group, 0), (group, written, expected_writes.get(group, 0))


@pytest.mark.parametrize(
    "dtypes,d,q,out_norm,prefix_dtype",
    [
        ((torch.float32, torch.bfloat16, torch.float16), 64, None, True, torch.bfloat16),
        ((torch.float32,) * 3, 100, 2, False, None),
        ((torch.bfloat16, torch.float32), 37, None, True, None),
    ],
)
@pytest.mark.parametrize("normalize_values", [False, True], ids=["raw-values", "normalised-values"])
def test_backward_moves_the_claimed_minimum(dtypes, d, q, out_norm, prefix_dtype, normalize_values):
    m, n = 40, len(dtypes)  # 40 rows: three row chunks of 16
    sources = [torch.randn(5, 8, d).to(dt) for dt in dtypes]
    _, launches, out, prefix = run_read(sources, q, out_norm, prefix_dtype, normalize_values)
    bwd = [x for x in launches if x.kernel.startswith("depth_attn_bwd")]
    sums = [x for x in launches if x.kernel.startswith("column_sum")]
    assert len(bwd) == 1, "one site tile"
    (bwd,) = bwd
    nq = 1 if q is None else q
    acc = 8 if out.dtype == torch.float64 else 4
    w = warps(bwd)
    chunks = -(-m // 16)
    assert teams(bwd) >= chunks
    per_row_scalars = (4 * nq * n) + n + nq * n  # logits (softmax stats x2, pass A, pass B), rinv, dlogits
    per_row_scalars += n if normalize_values else 0  # rinv again in pass A
    per_row_scalars += nq  # dlse
    per_row_scalars += nq if prefix else 0  # prefix lse
    expected_reads = {
        "sources": 2 * sum(nbytes(s) for s in sources),  # pass A (h) and pass B (dv): the floor of this schema
        "dy": nbytes(out),
        "prefix_out": nbytes(prefix[0]) if prefix else 0,
        "logits": 4 * nq * n * m * acc * w,
        "rinv": (2 if normalize_values else 1) * n * m * acc * w,
        "dlogits": nq * n * m * acc * w,
        "dlse": nq * m * acc * w,
        "prefix_lse": nq * m * acc * w if prefix else 0,
        "table": 2 * n * m * ROW_REF * w,
        "grad_table": n * m * ROW_REF * w,
        "u": chunks * nq * d * acc,  # once per row chunk
        "g": chunks * nq * d * acc if out_norm else 0,
    }
    assert sum(expected_reads[k] for k in ("logits", "rinv", "dlogits", "dlse", "prefix_lse")) == (
        per_row_scalars * m * acc * w
    )
    expected_writes = {
        "grad_sources": sum(nbytes(s) for s in sources),  # each gradient element once
        "grad_prefix_out": nbytes(prefix[0]) if prefix else 0,
        "grad_prefix_lse": nq * m * acc if prefix else 0,
        "du_part": chunks * nq * d * acc,
        "dg_part": chunks * nq * d * acc if out_norm else 0,
    }
    for group, (read, written) in bwd.traffic.items():
        assert read == expected_reads.get(group, 0), (group, read, expected_reads.get(group, 0))
        assert written == expected_writes.get(group, 0), (group, written, expected_writes.get(group, 0))
    # Stage 2 of the row reductions: each partial read once, du (dg) written once.
    assert len(sums) == (2 if out_norm else 1)
    for launch, name in zip(sums, ("du", "dg")):
        assert launch.read(f"{name}_part") == chunks * nq * d * acc
        assert launch.written(name) == nq * d * acc
        assert sum(r + wr for r, wr in launch.traffic.values()) == (chunks + 1) * nq * d * acc


def test_more_sites_than_a_tile_take_one_pass_each():
    """Q = 3 sites at D = 4096: one site per tile. The forward tiles run side by side
    (grid.y), each reading the sources; the backward's tiles run one after another,
    the later ones adding to the source gradients (read and written again)."""
    sources = [torch.randn(2, 4096) for _ in range(2)]
    fwd_launches, bwd_launches, _, _ = run_read(sources, 3, False)
    (fwd,) = fwd_launches
    assert fwd.grid[1] == 3
    src = sum(nbytes(s) for s in sources)
    assert fwd.read("sources") == 3 * src
    bwd = [x for x in bwd_launches if x.kernel.startswith("depth_attn_bwd")]
    assert len(bwd) == 3
    assert [x.read("sources") for x in bwd] == [2 * src] * 3
    assert [x.read("grad_sources") for x in bwd] == [0, src, src]
    assert [x.written("grad_sources") for x in bwd] == [src] * 3
