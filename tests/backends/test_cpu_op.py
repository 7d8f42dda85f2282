"""Properties specific to the C++ CPU op: determinism, torch.compile, build info."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from tests.support import (
    assert_backward_checks_saved_tensors,
    assert_close_to_oracle,
    make_sources,
    read_with_grads,
    run_check_in_subprocess,
    site_params,
)

pytestmark = pytest.mark.skipif("cpu" not in ak.available_backends("cpu"), reason=ak.build_info())


def forward_backward(sources, w, g, g_out, h_a=None, lse_a=None):
    srcs = [s.clone().requires_grad_() for s in sources]
    params = [p.clone().requires_grad_() for p in (w, g, g_out)]
    if h_a is None:
        out, lse = ak.depth_attention(
            params[0], srcs, params[1], out_norm_weight=params[2], return_lse=True, backend="cpu"
        )
        extra = []
    else:
        extra = [h_a.clone().requires_grad_(), lse_a.clone().requires_grad_()]
        out, lse = ak.depth_attention_merge(
            params[0], extra[0], extra[1], srcs, params[1], out_norm_weight=params[2], return_lse=True, backend="cpu"
        )
    torch.manual_seed(0)
    loss = (out * torch.randn_like(out)).sum() + (lse * torch.randn_like(lse)).sum()
    grads = torch.autograd.grad(loss, srcs + params + extra)
    return [out, lse, *grads]


MIXED = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "mixed"])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("q", [None, 3])
def test_bitwise_deterministic_across_runs_and_thread_counts(dtype, merge, q):
    # 1000 rows: many row chunks in the du reduction, uneven across 2 threads;
    # several blocks of the forward (one site reading rows in place: its row
    # pipeline; three sites: its tiles).
    dtypes = MIXED if dtype == "mixed" else [dtype] * 5
    sources = [s.to(dt) for s, dt in zip(make_sources(5, (10, 100), 96, torch.float64), dtypes)]
    w, g, g_out = site_params(q, 96)
    prefix = ()
    if merge:
        h_a, lse_a = reference.depth_attention(w, make_sources(2, (10, 100), 96, dtypes[1]), g, return_lse=True)
        prefix = (h_a, lse_a)  # h_a is not contiguous: exercises the copy-when-needed path
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = forward_backward(sources, w, g, g_out, *prefix)
        second = forward_backward(sources, w, g, g_out, *prefix)
        torch.set_num_threads(1)
        single = forward_backward(sources, w, g, g_out, *prefix)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_compile_fullgraph_matches_eager():
    sources = make_sources(4, (3, 5), 24)
    w, g, g_out = site_params(None, 24)

    def fn(w, g, g_out, *srcs):
        h, lse, weights = ak.depth_attention(
            w, list(srcs), g, out_norm_weight=g_out, return_lse=True, return_weights=True, backend="cpu"
        )
        h_a, lse_a = ak.depth_attention(w, list(srcs[:2]), g, return_lse=True, backend="cpu")
        merged = ak.depth_attention_merge(w, h_a, lse_a, list(srcs[2:]), g, backend="cpu")
        return (h * 1.5).sum() + lse.sum() + (weights**2).sum() + merged.square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = [t.clone().requires_grad_() for t in (w, g, g_out, *sources)]
    eager_loss = fn(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs)
    compiled_loss = compiled(*inputs)
    compiled_grads = torch.autograd.grad(compiled_loss, inputs)
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_nn_model():
    model = ak.nn.BlockAttnResTransformer(31, 16, 2, 2, layers_per_block=1, backend="cpu", attention_backend="sdpa")
    idx = torch.randint(0, 31, (2, 5))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(idx), model(idx))


def test_build_info_names_the_vector_isa_and_the_cuda_kernels():
    from attnres_kernels.ops import _native

    info = ak.build_info()
    assert "CPU vector ISA" in info
    assert info.startswith(torch.ops.attnres.build_info())
    built = _native.has_kernel("depth_attn_fwd", "cuda")
    assert info.endswith("CUDA kernels: registered" if built else "CUDA kernels: not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, "mixed"])
@pytest.mark.parametrize("d", [1000, 64, 40])
@pytest.mark.parametrize(
    "q,out_norm,merge",
    [(None, False, False), (None, True, True), (3, True, False), (2, False, True), (6, False, False)],
)
def test_forward_schedules_over_many_rows_match_reference(dtype, d, q, out_norm, merge):
    # 437 rows. One site reading every row in place (q=None, one dtype) takes
    # the forward's row pipeline: two blocks, the second partial, each with a
    # first and last half sweep; D=1000 and 40 end in a shorter vector step
    # and a scalar tail. Several sites or mixed dtypes take the row tiles:
    # several blocks of several tiles (pass B of each prefetches the next),
    # the last tile and the last block partial. bf16 rows of several sites
    # are swept for up to 4 sites at once (6 sites: a group of 4, then 2).
    from tests.ops.test_fused_reads import compare_read

    dtypes = MIXED[:4] + MIXED[:4] + [torch.float32] if dtype == "mixed" else [dtype] * 9
    sources = [s.to(dt) for s, dt in zip(make_sources(9, (19, 23), d, torch.float64), dtypes)]
    compare_read("cpu", sources, q=q, out_norm=out_norm, prefix_split=2 if merge else None)


def check_large_outputs_on_page_boundaries(expect_reuse: bool):
    """Outputs of 1 MiB or more come from the op's buffer cache, each starting on a page boundary
    (the backward writes its source gradients fastest at one page offset), also when a buffer freed
    by an earlier call is handed out again (expect_reuse: the cache keeps freed buffers): the second
    call's output and gradients, written into the first call's buffers, are those of the reference."""
    torch.ops.attnres.empty_cpu_cache()
    sources = make_sources(3, (600,), 1000, torch.float32)  # 2.4 MB per output
    w, g, _ = site_params(None, 1000)
    torch.manual_seed(0)
    grad_out = torch.randn(600, 1000)

    def output_and_grads(impl, srcs, params, **kw):
        srcs = [s.clone().requires_grad_() for s in srcs]
        out = impl.depth_attention(*params[:1], srcs, *params[1:], **kw)
        return [out, *torch.autograd.grad(out, srcs, grad_out.to(out.dtype))]

    same = output_and_grads(reference, sources, (w, g))
    oracle = output_and_grads(reference, [s.double() for s in sources], (w.double(), g.double()))
    first_buffers = None
    for _ in range(2):
        got = output_and_grads(ak, sources, (w, g), backend="cpu")
        buffers = [t.data_ptr() for t in got[:4]]  # the output and the 3 source gradients
        assert [p % 4096 for p in buffers] == [0] * 4, [hex(p) for p in buffers]
        for name, a, b, c in zip(["out", "d_source_0", "d_source_1", "d_source_2"], got, same, oracle):
            assert_close_to_oracle(name, a, b, c)
        if first_buffers is not None and expect_reuse:
            assert set(buffers) == set(first_buffers), "the freed buffers were not handed out again"
        first_buffers = buffers
        del got, a  # (a: the last gradient) frees the buffers for the next call


@pytest.mark.parametrize("cache_mb", [None, "0"])
def test_large_outputs_start_on_a_page_boundary_and_reuse_freed_buffers(cache_mb):
    """check_large_outputs_on_page_boundaries in a subprocess (the cache reads ATTNRES_CPU_CACHE_MB once
    per process): with the default limit, freed buffers are handed out again; with 0 none is kept, and
    the outputs are still page-aligned."""
    call = f"check_large_outputs_on_page_boundaries(expect_reuse={cache_mb is None})"
    run_check_in_subprocess(__name__, call, {"ATTNRES_CPU_CACHE_MB": cache_mb})


def check_cache_follows_the_shapes_in_use():
    """The buffer cache (here limited to 12 MiB) keeps the buffers of the shapes a program uses now:
    freed buffers of a new shape displace those that an earlier shape left, so a second call of the new
    shape takes all of its outputs (its result and its three source gradients) from the cache."""
    torch.ops.attnres.empty_cpu_cache()
    w = torch.randn(1000)

    def read(rows):  # the output and the 3 source gradients, 1 MiB or more each: buffers of the cache
        sources = [torch.randn(rows, 1000).requires_grad_() for _ in range(3)]
        out = ak.depth_attention(w, sources, backend="cpu")
        return [out, *torch.autograd.grad(out, sources, torch.ones_like(out))]

    def buffer_bytes(rows):  # each buffer is a whole number of pages
        return -(-rows * 1000 * 4 // 4096) * 4096

    first = read(600)
    assert torch.ops.attnres.cpu_cache_stats() == [0, 0, 4 * buffer_bytes(600)]
    del first
    assert torch.ops.attnres.cpu_cache_stats() == [4 * buffer_bytes(600), 4, 0]
    # 700 rows: no 600-row buffer fits; freed, the four new buffers displace the four old ones (all
    # eight would take 20.8 MB).
    del read(700)[:]
    assert torch.ops.attnres.cpu_cache_stats() == [4 * buffer_bytes(700), 4, 0]
    again = read(700)
    assert torch.ops.attnres.cpu_cache_stats() == [0, 0, 4 * buffer_bytes(700)]
    del again


def test_cache_follows_the_shapes_in_use():
    """check_cache_follows_the_shapes_in_use in a subprocess (the limit is read once per process)."""
    run_check_in_subprocess(__name__, "check_cache_follows_the_shapes_in_use()", {"ATTNRES_CPU_CACHE_MB": "12"})


@pytest.mark.parametrize("q", [2, 3])
def test_multi_site_bf16_forward_streams_its_output_rows(q):
    """Several sites over bf16 rows, no output norm, an output of at least 8 MiB (2100 rows x q x 1024
    bf16): the sweep rounds each output vector straight into its row with non-temporal stores. Outputs
    and gradients against the reference."""
    from tests.ops.test_fused_reads import compare_read

    compare_read("cpu", make_sources(5, (2100,), 1024, torch.bfloat16), q=q, out_norm=False)


@pytest.mark.parametrize(
    "n,rows,d,q,dtype",
    [
        (9, 40, 100, None, torch.bfloat16),  # two groups of sources (5 + 4), a tail past 96
        (17, 40, 64, 3, torch.bfloat16),  # three (6 + 6 + 5), 3 sites
        (17, 300, 1024, None, torch.float32),  # 20 MiB of source gradients: streamed
        (33, 20, 48, 2, torch.float32),  # five groups (7 + 7 + 7 + 6 + 6)
    ],
)
def test_backward_sweep_over_many_sources(n, rows, d, q, dtype):
    """The source-gradient sweep takes more than 8 sources in groups, each adding its part of du: outputs and
    all gradients against the reference, with and without the output norm."""
    from tests.ops.test_fused_reads import compare_read

    sources = make_sources(n, (rows,), d, dtype)
    for out_norm in (False, True):
        compare_read("cpu", sources, q=q, out_norm=out_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharp_softmax_weights_below_the_normal_range(dtype):
    # Logits ~100 apart: many softmax weights fall below the smallest normal
    # float (the kernel, accumulating in fp32, flushes those to 0: see its
    # flush_subnormal) or underflow to 0.
    sources = make_sources(9, (300,), 256, dtype)
    w = (8.0 * torch.randn(256)).to(dtype)
    g = torch.ones(256, dtype=dtype)
    out_weights = [torch.randn(300, 256, dtype=torch.float64), torch.randn(300, dtype=torch.float64)]

    def run(backend):
        def fn(srcs, w, g):
            return ak.depth_attention(w, srcs, g, return_lse=True, backend=backend)

        return fn

    fused = read_with_grads(run("cpu"), sources, [w, g], out_weights)
    same = read_with_grads(run("reference"), sources, [w, g], out_weights)
    oracle = read_with_grads(run("reference"), [s.double() for s in sources], [w.double(), g.double()], out_weights)
    weights = reference.depth_attention(w.double(), [s.double() for s in sources], g.double(), return_weights=True)[1]
    assert ((weights > 0) & (weights < torch.finfo(torch.float32).tiny)).sum() > 100
    for name, a, b, c in zip(["out", "lse"], fused[0], same[0], oracle[0]):
        assert_close_to_oracle(name, a, b, c)

    def grouped(grads):  # the 9 source gradients judged as one tensor
        return [torch.cat([x.flatten() for x in grads[:9]]), *grads[9:]]

    for name, a, b, c in zip(["d_sources", "d_query", "d_norm"], *(grouped(r[1]) for r in (fused, same, oracle))):
        assert_close_to_oracle(name, a, b, c)


@pytest.mark.parametrize(
    "dtype,d,merge,q",
    [
        (torch.float32, 1008, False, None),
        (torch.float32, 1008, True, None),
        (torch.bfloat16, 1024, False, None),
        (torch.float16, 1024, True, None),
        (torch.float32, 1008, False, 2),
        (torch.bfloat16, 1024, True, 2),
    ],
)
def test_large_outputs_streamed_from_the_weighted_sum_match_reference(dtype, d, merge, q):
    # Outputs of 8 MiB and more without an output norm, rows aligned to the
    # vector size, are written by the weighted sum itself with non-temporal
    # stores (bf16 and fp16 need D a multiple of 64); other outputs go through
    # a row buffer. One site: the row pipeline's weighted sum (fp32 D=1008:
    # 31 two-vector steps, then a scalar tail); two sites: the tiles'
    # (15 four-vector steps, then single vectors).
    rows = (8 << 20) // (d * dtype.itemsize * (q or 1)) + 37
    sources = make_sources(3, (rows,), d, dtype)
    w, g, _ = site_params(q, d)
    if merge:
        h_a, lse_a = reference.depth_attention(w, make_sources(2, (rows,), d, dtype), g, return_lse=True)
        run = lambda impl, srcs, w, g, **k: impl.depth_attention_merge(w, h_a, lse_a, srcs, g, return_lse=True, **k)
    else:
        run = lambda impl, srcs, w, g, **k: impl.depth_attention(w, srcs, g, return_lse=True, **k)
    fused = run(ak, sources, w, g, backend="cpu")
    same = run(reference, sources, w, g)
    oracle = run(reference, [s.double() for s in sources], w.double(), g.double())
    for name, a, b, c in zip(["out", "lse"], fused, same, oracle):
        assert a.dtype == b.dtype
        assert_close_to_oracle(name, a, b, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows,d,q,out_norm,normalize,out_fp32",
    [
        (1400, 1024, None, False, False, False),  # 8.2 (bf16) MiB of source gradients: streamed (64-byte aligned rows)
        (1400, 1024, 3, True, False, False),  # 3 sites + out norm, streamed (AVX2 bf16: a cache line of 2 vectors)
        (1400, 1000, 2, True, False, False),  # rows not aligned: stored; a tail past the last 32 values
        (9000, 64, None, True, True, False),  # 36-row chunks: du and dg summed in float over 32 rows, then 4
        (300, 80, 3, False, True, False),  # 5 vector pairs of bf16 a row: 3 sites' line steps, then a pair
        (300, 48, None, True, False, False),  # 3 vector pairs of bf16 a row: one site's line steps, then a pair
        (300, 1000, 3, False, False, False),  # no out norm: dy's bf16 rows converted straight to do, a tail past 992
        (300, 1000, 3, True, False, True),  # out norm, fp32 output gradients of (bf16) sources, a tail
        (300, 100, 4, True, False, False),  # the most sites one sweep serves
        (300, 64, 5, False, False, False),  # more: the float path
    ],
)
def test_backward_sweeps_read_rows_in_place(dtype, rows, d, q, out_norm, normalize, out_fp32):
    """The backward of bf16 or fp32 sources without a merge prefix, for up to 4 sites, sweeps over
    the rows in place (bf16 without a float copy), every site at once, and forms du in the same
    sweep as the source gradients; without an out norm it converts the output gradients straight
    into the order those sweeps read: gradients (of the out-norm weight too) against the reference."""
    sources = make_sources(3, (rows,), d, dtype)
    w, g, g_out = site_params(q, d)
    kw = dict(normalize_values=normalize, scale=0.5, out_dtype=torch.float32 if out_fp32 else None)
    gamma = None if normalize else g

    def grads(impl, srcs, params, **extra):
        srcs = [s.detach().clone().requires_grad_() for s in srcs]
        params = [p.detach().clone().requires_grad_() for p in params]
        w_, g_, g_out_ = params
        g_out_ = g_out_ if out_norm else None
        out = impl.depth_attention(w_, srcs, g_ if gamma is not None else None, out_norm_weight=g_out_, **kw, **extra)
        torch.manual_seed(3)
        grad_out = torch.randn(out.shape, dtype=torch.float64)
        wrt = [w_] + ([] if gamma is None else [g_]) + ([] if g_out_ is None else [g_out_])
        return torch.autograd.grad((out.double() * grad_out).sum(), srcs + wrt)

    fused = grads(ak, sources, [w, g, g_out], backend="cpu")
    same = grads(reference, sources, [w, g, g_out])
    oracle = grads(reference, [s.double() for s in sources], [w.double(), g.double(), g_out.double()])
    assert [t.dtype for t in fused] == [t.dtype for t in same]
    grouped = lambda r: [torch.cat([x.flatten() for x in r[:3]]), *r[3:]]
    names = ["d_sources", "d_query"] + ([] if gamma is None else ["d_norm"]) + (["d_out_norm"] if out_norm else [])
    assert len(names) == len(fused) - 2
    for name, a, b, c in zip(names, grouped(fused), grouped(same), grouped(oracle)):
        assert_close_to_oracle(name, a, b, c)


def _param(shape, dtype, layout, shift=0.0, scale=1.0):
    """shift + scale * N(0, 1) of `shape` ([D] or [Q, D]) laid out as every other element of a wider
    tensor, or (for [Q, D]) as the transpose of a [D, Q] tensor; contiguous otherwise."""
    if layout == "every other":
        return (shift + scale * torch.randn(*shape[:-1], 2 * shape[-1], dtype=torch.float64)).to(dtype)[..., ::2]
    if layout == "transposed" and len(shape) == 2:
        return (shift + scale * torch.randn(shape[1], shape[0], dtype=torch.float64)).to(dtype).t()
    return (shift + scale * torch.randn(shape, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "q,w_shared,g_shared,layout",
    [
        (None, True, True, "every other"),
        (3, True, True, "every other"),
        (3, True, False, "transposed"),
        (3, False, True, "transposed"),
        (3, False, False, "every other"),
    ],
)
def test_site_parameters_of_any_shape_dtype_and_layout(param_dtype, q, w_shared, g_shared, layout):
    """The CPU op forms u = (query ⊙ norm_weight) · scale and the output-norm weight from [D] (shared by
    the sites) or [Q, D] parameters of any float dtype and strides: outputs and gradients are bitwise
    those of contiguous copies of the parameters, and as close to the fp64 reference as PyTorch's."""
    d = 37
    sources = make_sources(3, (2, 5), d)
    site_shape = (d,) if q is None else (q, d)
    query = _param(site_shape, param_dtype, layout, scale=0.5)
    norm_weight = _param((d,) if w_shared else site_shape, param_dtype, layout, 1.0, 0.3)
    out_norm_weight = _param((d,) if g_shared else site_shape, param_dtype, layout, 1.0, 0.3)
    assert not query.is_contiguous()

    def run(read, srcs, params, **backend):
        srcs = [s.detach().clone().requires_grad_() for s in srcs]
        params = [p.detach().requires_grad_() for p in params]
        out = read(params[0], srcs, params[1], out_norm_weight=params[2], scale=0.37, **backend)
        torch.manual_seed(0)
        return [out, *torch.autograd.grad((out * torch.randn(out.shape, dtype=out.dtype)).sum(), srcs + params)]

    params = [query, norm_weight, out_norm_weight]
    fused = run(ak.depth_attention, sources, params, backend="cpu")
    contiguous = run(ak.depth_attention, sources, [p.contiguous() for p in params], backend="cpu")
    for k, (a, b) in enumerate(zip(fused, contiguous)):
        assert a.dtype == b.dtype and torch.equal(a, b), k
    same = run(reference.depth_attention, sources, params)
    oracle = run(reference.depth_attention, [s.double() for s in sources], [p.double() for p in params])
    for k, (a, b, c) in enumerate(zip(fused, same, oracle)):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert_close_to_oracle(f"result {k}", a, b, c)


def test_backward_checks_the_saved_tensors():
    assert_backward_checks_saved_tensors(torch.ops.attnres.depth_attn_fwd, torch.ops.attnres.depth_attn_bwd)
