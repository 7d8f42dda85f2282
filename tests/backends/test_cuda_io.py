"""The I/O floor of the CUDA depth-read kernels, counted by the SIMT harness.

Every global-memory access of a launch is attributed to the buffer it touches
(anything else is "untracked", which must stay 0). The forward must read each
source element once and write each output element once, plus O(N) per-row
scalars; the backward must move what the kernel header's formula claims
(csrc/cuda/depth_attention_kernels.cuh): one read of the sources where the
row's sources fit in shared memory (the source cache, fp32 math), else two; one
write of their gradients, the site parameters once per team, one partial per row chunk,
and site_grads_kernel reading each partial once and writing each parameter
gradient once. The source table travels in the kernel parameters (no global
reads). Scalars every lane of a warp loads from one address count once per warp
(W warps per row team), as a GPU serves them with one request.
"""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.cuda import emulation
from tests.support import site_params

pytestmark = pytest.mark.usefixtures("cuda_emulation")


def nbytes(t):
    return t.numel() * t.element_size() if t is not None else 0


# The read's variants: raw values (paper), Inkling2's normalised values (no key-norm weight),
# normalised values with a key-norm weight, sliced low-rank keys of R = D // 3 + 1 columns.
VARIANTS = ["raw-values", "normalised-values", "weighted-normalised-values", "low-rank-keys"]


def read_params(variant, q, d):
    """query, norm_weight, out_norm_weight and the read's keyword options for a variant."""
    rank = d // 3 + 1 if variant == "low-rank-keys" else d
    w, g, g_out = site_params(q, rank)
    _, _, g_out = site_params(q, d)
    kwargs = {}
    if variant == "normalised-values":
        g = None
    if variant in ("normalised-values", "weighted-normalised-values"):
        kwargs.update(normalize_values=True, scale=d**-0.5)
    if variant == "low-rank-keys":
        kwargs.update(key_rank=rank)
    return w, g, g_out, kwargs, rank


def run_read(sources, q, out_norm, prefix_dtype=None, variant="raw-values"):
    """One forward + backward through backend="cuda"; returns the launch records, the output, the
    prefix and the site parameters."""
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    w, g, g_out, options, rank = read_params(variant, q, d)
    g_out = g_out if out_norm else None
    srcs = [s.clone().requires_grad_() for s in sources]
    params = [p.clone().requires_grad_() if p is not None else None for p in (w, g, g_out)]
    kwargs = dict(options, out_norm_weight=params[2], return_lse=True, backend="cuda")
    prefix = None
    if prefix_dtype is not None:
        h_a, lse_a = reference.depth_attention(
            w, [torch.randn(*lead, d) for _ in range(2)], g, return_lse=True, **options
        )
        prefix = (h_a.to(prefix_dtype), lse_a)
        out, lse = ak.depth_attention_merge(params[0], *prefix, srcs, params[1], **kwargs)
    else:
        out, lse = ak.depth_attention(params[0], srcs, params[1], **kwargs)
    fwd_launches = emulation.launch_log()
    (out.double().sum() + lse.sum()).backward()
    bwd_launches = emulation.launch_log()
    return fwd_launches, bwd_launches, out, prefix, (w, g, g_out), rank


def warps(launch):
    return launch.block[0] // 32


def teams(launch):
    return launch.grid[0] * launch.grid[1] * launch.block[1]


def assert_traffic(launch, reads, writes):
    for group, (read, written) in launch.traffic.items():
        assert read == reads.get(group, 0), (launch.kernel, group, read, reads.get(group, 0))
        assert written == writes.get(group, 0), (launch.kernel, group, written, writes.get(group, 0))
    for group in set(reads) | set(writes):  # every expected buffer was touched as claimed
        assert launch.traffic.get(group, (0, 0)) == (reads.get(group, 0), writes.get(group, 0)), group


def staged_reads(variant, params, nq, rank, d):
    """Bytes one row team reads to stage its site parameters: the rows of query and norm_weight
    (R columns) for u, out_norm_weight's (D) for g, and norm_weight's again (D) for the values'
    weight of weighted normalised values."""
    w, g, g_out = params
    size = lambda t: t.element_size() if t is not None else 0
    norm_reads = nq * rank * size(g) + (nq * d * size(g) if variant == "weighted-normalised-values" else 0)
    return {"query": nq * rank * size(w), "norm_weight": norm_reads, "out_norm_weight": nq * d * size(g_out)}


@pytest.mark.parametrize(
    "dtypes,d,q,out_norm,prefix_dtype",
    [
        ((torch.float32, torch.bfloat16, torch.float16), 64, None, True, torch.bfloat16),  # vector path, merge
        ((torch.float32,) * 4, 100, 3, False, None),  # several sites in one tile
        ((torch.bfloat16, torch.float32), 37, None, True, None),  # unaligned rows: element loads
        ((torch.float64, torch.float32), 640, 2, True, torch.float64),  # 32 warps per row
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_reads_each_source_once_and_writes_each_output_once(dtypes, d, q, out_norm, prefix_dtype, variant):
    m, n = 12, len(dtypes)
    sources = [torch.randn(3, 4, d).to(dt) for dt in dtypes]
    (fwd,), _, out, prefix, params, rank = run_read(sources, q, out_norm, prefix_dtype, variant)
    nq = 1 if q is None else q
    acc = 8 if out.dtype == torch.float64 else 4
    assert fwd.grid[1] == 1, "one site tile: the sources are read once for all sites"
    staged = {k: teams(fwd) * v for k, v in staged_reads(variant, params, nq, rank, d).items()}
    expected_reads = {
        "sources": sum(nbytes(s) for s in sources),  # each source element once
        **staged,  # once per row team
        "prefix_out": nbytes(prefix[0]) if prefix else 0,
        "prefix_lse": nq * m * acc * warps(fwd) if prefix else 0,
    }
    expected_writes = {
        "out": nbytes(out),  # each output element once
        "lse": nq * m * acc,
        "logits": nq * n * m * acc,
        "rinv": n * m * acc,
    }
    assert_traffic(fwd, expected_reads, expected_writes)


@pytest.mark.parametrize(
    "dtypes,d,q,out_norm,prefix_dtype,cached",
    [
        ((torch.float32, torch.bfloat16, torch.float16), 64, None, True, torch.bfloat16, True),
        ((torch.float32,) * 3, 100, 2, False, None, True),
        ((torch.bfloat16, torch.float32), 37, None, True, None, True),
        ((torch.float32,) * 3, 4096, None, True, None, False),  # 3 x 16 KiB rows: no room for the cache
        ((torch.float64, torch.float32), 40, None, False, None, False),  # fp64 math: no cache
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_moves_the_claimed_minimum(dtypes, d, q, out_norm, prefix_dtype, cached, variant):
    m, n = 40, len(dtypes)  # 40 rows: three row chunks of 16
    sources = [torch.randn(5, 8, d).to(dt) for dt in dtypes]
    _, launches, out, prefix, params, rank = run_read(sources, q, out_norm, prefix_dtype, variant)
    bwd = [x for x in launches if x.kernel.startswith("depth_attn_bwd")]
    assert len(bwd) == 1, "one site tile"
    (bwd,) = bwd
    assert bwd.kernel.endswith("[cache]") == cached, bwd.kernel
    (site_grads,) = [x for x in launches if x is not bwd]
    assert site_grads.kernel.startswith("site_grads<")
    nq = 1 if q is None else q
    acc = 8 if out.dtype == torch.float64 else 4
    w = warps(bwd)
    chunks = -(-m // 16)
    assert teams(bwd) >= chunks
    normalised = variant in ("normalised-values", "weighted-normalised-values")
    weighted = variant == "weighted-normalised-values"
    per_row_scalars = (4 * nq * n) + n + nq * n  # logits (softmax stats x2, pass A, pass B), rinv, dlogits
    per_row_scalars += n if normalised else 0  # rinv again in pass A
    per_row_scalars += nq  # dlse
    per_row_scalars += nq if prefix else 0  # prefix lse
    expected_reads = {
        # Once into the cache, else in pass A (h) and again in pass B (dv).
        "sources": (1 if cached else 2) * sum(nbytes(s) for s in sources),
        "dy": nbytes(out),
        "prefix_out": nbytes(prefix[0]) if prefix else 0,
        "logits": 4 * nq * n * m * acc * w,
        "rinv": (2 if normalised else 1) * n * m * acc * w,
        "dlogits": nq * n * m * acc * w,
        "dlse": nq * m * acc * w,
        "prefix_lse": nq * m * acc * w if prefix else 0,
        # Staged once per row chunk.
        **{k: chunks * v for k, v in staged_reads(variant, params, nq, rank, d).items()},
    }
    assert sum(expected_reads[k] for k in ("logits", "rinv", "dlogits", "dlse", "prefix_lse")) == (
        per_row_scalars * m * acc * w
    )
    expected_writes = {
        "grad_sources": sum(nbytes(s) for s in sources),  # each gradient element once
        "grad_prefix_out": nbytes(prefix[0]) if prefix else 0,
        "grad_prefix_lse": nq * m * acc if prefix else 0,
        "du_part": chunks * nq * rank * acc,  # the key columns only
        "dg_part": chunks * nq * d * acc if out_norm else 0,
        "dvw_part": chunks * nq * d * acc if weighted else 0,
    }
    assert_traffic(bwd, expected_reads, expected_writes)
    # Stage 2 of the row reductions: each partial read once, each parameter gradient written once
    # (query and norm_weight read once per site for the products).
    w_, g, g_out = params
    assert_traffic(
        site_grads,
        reads={
            "du_part": chunks * nq * rank * acc,
            "dg_part": chunks * nq * d * acc if out_norm else 0,
            "dvw_part": chunks * nq * d * acc if weighted else 0,
            "query": nq * rank * w_.element_size() if g is not None else 0,
            "norm_weight": nq * rank * g.element_size() if g is not None else 0,
        },
        writes={
            "grad_query": nbytes(w_),
            "grad_norm_weight": nbytes(g),
            "grad_out_norm_weight": nbytes(g_out) if out_norm else 0,
        },
    )


def test_more_sites_than_a_tile_take_one_pass_each():
    """Q = 3 sites at D = 4096: one site per tile. The forward tiles run side by side
    (grid.y), each reading the sources; the backward's tiles run one after another,
    each reading the sources once (into its source cache), the later ones adding to the
    source gradients (read and written again)."""
    sources = [torch.randn(2, 4096) for _ in range(2)]
    fwd_launches, bwd_launches, *_ = run_read(sources, 3, False)
    (fwd,) = fwd_launches
    assert fwd.grid[1] == 3
    src = sum(nbytes(s) for s in sources)
    assert fwd.read("sources") == 3 * src
    bwd = [x for x in bwd_launches if x.kernel.startswith("depth_attn_bwd")]
    assert len(bwd) == 3
    assert all(x.kernel.endswith("[cache]") for x in bwd), "two 16 KiB rows fit the source cache"
    assert [x.read("sources") for x in bwd] == [src] * 3
    assert [x.read("grad_sources") for x in bwd] == [0, src, src]
    assert [x.written("grad_sources") for x in bwd] == [src] * 3
