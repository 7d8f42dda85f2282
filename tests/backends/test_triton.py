"""Properties specific to the Triton backend (interpreter on CPU; real GPU where marked ``cuda``)."""

import pytest
import torch

import attnres_kernels as ak
import attnres_kernels.triton as triton_backend
from attnres_kernels import reference
from tests.support import assert_close_to_oracle, make_sources, run_check_in_subprocess, site_params

pytestmark = pytest.mark.skipif(triton_backend.IMPORT_ERROR is not None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fresh tensors from ``Tensor.new_empty`` (what the launchers allocate
    outputs, gradients and partials with) start as NaN: any element a kernel
    fails to write shows up in the comparison."""
    original = torch.Tensor.new_empty

    def new_empty_nan(self, *args, **kwargs):
        t = original(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty_nan)


@pytest.mark.skipif(not triton_backend.INTERPRETING, reason="a GPU rounds fp32 -> bf16 to nearest even itself")
def test_the_interpreter_rounds_bf16_as_a_gpu_does():
    """The test setup (conftest.py) makes Triton's interpreter round fp32 -> bf16 to nearest even, ties to even,
    NaN kept, as a GPU and PyTorch do (unpatched it drops the low 16 bits): explicit casts and stores alike."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_and_store(x_ptr, cast_ptr, store_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(cast_ptr + offs, x.to(tl.bfloat16), mask=offs < n)
        tl.store(store_ptr + offs, x, mask=offs < n)

    ulp = 2.0**-7  # of bf16 at 1.0
    ties = [1 + ulp / 2, 1 + 1.5 * ulp, -(1 + ulp / 2)]  # to even: 1, 1 + 2 ulp, -1
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0e38, 1e-40]
    x = torch.cat([torch.randn(1000), torch.tensor(ties + special)]).float()
    cast, stored = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.bfloat16)
    cast_and_store[(1,)](x, cast, stored, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.to(torch.bfloat16)
    for got in (cast, stored):
        assert torch.equal(got.isnan(), expected.isnan())
        finite = ~expected.isnan()
        assert torch.equal(got[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert (x.to(torch.bfloat16) != (x.view(torch.int32) & -65536).view(torch.float32)).sum() > 300


def _run(backend, sources, w, g, g_out, h_a=None, lse_a=None):
    srcs = [s.clone().requires_grad_() for s in sources]
    params = [p.clone().requires_grad_() for p in (w, g, g_out)]
    extra = [] if h_a is None else [h_a.clone().requires_grad_(), lse_a.clone().requires_grad_()]
    if extra:
        out, lse = ak.depth_attention_merge(
            params[0], *extra, srcs, params[1], out_norm_weight=params[2], return_lse=True, backend=backend
        )
    else:
        out, lse = ak.depth_attention(
            params[0], srcs, params[1], out_norm_weight=params[2], return_lse=True, backend=backend
        )
    gen = torch.Generator(device=out.device).manual_seed(1)
    rand = lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device)
    loss = (out * rand(out)).sum() + (lse * rand(lse)).sum()
    return [out, lse, *torch.autograd.grad(loss, srcs + params + extra)]


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("merge", [False, True])
def test_site_groups_and_poisoned_buffers(monkeypatch, merge):
    """Q = 3 sites split into 3 launches (the tile limit shrunk to one site) must
    equal the C++ op, with every output element written."""
    from attnres_kernels.triton import depth_attention_ops as launch

    monkeypatch.setattr(launch, "MULTI_SITE_TILE", launch.MIN_BLOCK_D)
    assert launch.kernel_config(100, 3, torch.float64).block_q == 1
    sources = make_sources(3, (2, 3), 100, torch.float64, "strided")
    w, g, g_out = site_params(3, 100, torch.float64)
    prefix = ()
    if merge:
        prefix = reference.depth_attention(w, make_sources(2, (2, 3), 100, torch.float64), g, return_lse=True)
    got = _run("triton", sources, w, g, g_out, *prefix)
    want = _run("cpu", sources, w, g, g_out, *prefix)
    for a, b in zip(got, want):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("poisoned_allocations")
def test_mixed_dtypes_out_of_slot_order_with_site_groups(monkeypatch):
    """Sources of four dtypes in no slot order (fp64 among them: fp64 accumulation and the
    fp64 slot), one of them unaligned, Q = 3 sites in 3 launches (so later groups add to the
    source gradients in each source's dtype), a bf16 merge prefix: every output and gradient
    written, in its own dtype, equal to the reference computed in fp64."""
    from attnres_kernels.triton import depth_attention_ops as launch

    monkeypatch.setattr(launch, "MULTI_SITE_TILE", launch.MIN_BLOCK_D)
    dtypes = [torch.bfloat16, torch.float64, torch.float32, torch.float16, torch.bfloat16]
    sources = [s.to(dt) for s, dt in zip(make_sources(5, (2, 3), 20, torch.float64), dtypes)]
    sources[2] = torch.randn(2 * 3 * 20 + 1)[1:].view(2, 3, 20)  # fp32 starting 4 bytes into its storage
    assert launch._slot_layout(sources).order == [1, 2, 3, 0, 4]
    w, g, g_out = site_params(3, 20, torch.float64)
    h_a, lse_a = reference.depth_attention(w, make_sources(2, (2, 3), 20, torch.float64), g, return_lse=True)
    h_a = h_a.to(torch.bfloat16)
    got = _run("triton", sources, w, g, g_out, h_a, lse_a)
    want = _run("reference", sources, w, g, g_out, h_a, lse_a)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and not a.isnan().any(), k
        # bf16 source gradients are rounded once per site-group launch (3 launches add to them):
        # the error is an ulp of the partial sums (up to ~4 here), not of the result.
        rtol, atol = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}.get(
            a.dtype, (2e-2, 4e-2)
        )
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    for s, grad in zip(sources, got[2:7]):
        assert grad.dtype == s.dtype


def test_slot_layout():
    from attnres_kernels.triton import depth_attention_ops as launch

    f64, f32, f16, bf16 = launch.SLOT_DTYPES
    mk = lambda *dts: [torch.empty(0, dtype=dt) for dt in dts]
    assert launch._slot_layout(mk(f32, bf16, bf16)) == (None, (0, 0, 1, 1, 3))
    assert launch._slot_layout(mk(bf16, bf16)) == (None, (0, 0, 0, 0, 2))
    assert launch._slot_layout(mk(bf16, f32, f16, f32)) == ([1, 3, 2, 0], (0, 0, 2, 3, 4))
    assert launch._slot_layout(mk(f16, f64)).arrange(["a", "b"]) == ["b", "a"]


def test_row_layouts_read_rows_in_place():
    """A contiguous source is its own rows, rows of a view keep their stride, and only a source
    whose columns are not adjacent is copied; each row layout addresses the source's elements."""
    from attnres_kernels.triton import depth_attention_ops as launch

    wide = torch.randn(2, 3, 16)
    sources = [torch.randn(2, 3, 8), wide[..., :8], wide[..., ::2]]
    rows, strides = launch._row_layouts(sources, 8)
    assert rows[0] is sources[0] and strides[0] == 8
    assert rows[1].data_ptr() == wide.data_ptr() and strides[1] == 16
    assert rows[2].is_contiguous() and strides[2] == 8
    for source, r, stride in zip(sources, rows, strides):
        flat = torch.as_strided(r, (6, 8), (stride, 1))
        torch.testing.assert_close(flat, source.reshape(6, 8), rtol=0, atol=0)


def test_launch_tables_are_reused_by_content():
    from attnres_kernels.triton import depth_attention_ops as launch

    cpu = torch.device("cpu")
    first = launch._int64_tables(([0, 5, 9], [8, 8, 8]), cpu)
    assert [t.tolist() for t in first] == [[0, 5, 9], [8, 8, 8]]
    assert all(a is b for a, b in zip(first, launch._int64_tables(([0, 5, 9], [8, 8, 8]), cpu)))
    other = launch._int64_tables(([0, 5, 9], [8, 8, 16]), cpu)
    assert [t.tolist() for t in other] == [[0, 5, 9], [8, 8, 16]]


def test_launch_helpers_match_triton():
    """The launchers' integer helpers give what triton.cdiv / triton.next_power_of_2 give."""
    import triton

    for n in range(1, 300):
        assert triton_backend.next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 7, 8, 128):
            assert triton_backend.cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_triton_kernels_are_launched(monkeypatch):
    """Counts launches of the real kernels: a fallback could not produce them."""
    from attnres_kernels.triton import depth_attention_ops as launch

    launches = {}

    class Spy:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launches[self.name] = launches.get(self.name, 0) + 1
            return self.kernel[grid]

    for name in ("depth_attn_fwd_kernel", "depth_attn_bwd_kernel", "column_sum_kernel"):
        monkeypatch.setattr(launch, name, Spy(getattr(launch, name), name))
    sources = [s.requires_grad_() for s in make_sources(3, (4,), 8)]
    w, g, _ = site_params(None, 8)
    ak.depth_attention(w, sources, g, backend="triton").sum().backward()
    assert launches == {"depth_attn_fwd_kernel": 1, "depth_attn_bwd_kernel": 1, "column_sum_kernel": 1}


def test_every_dispatcher_config_respects_the_register_budget():
    from attnres_kernels.triton import depth_attention_ops as launch

    for dtype, words in ((torch.bfloat16, 1), (torch.float32, 1), (torch.float64, 2)):
        configs = launch.all_kernel_configs(dtype)
        assert configs, dtype
        for cfg in configs:
            tile_words = cfg.block_q * cfg.block_d * words
            assert tile_words <= launch.MULTI_SITE_TILE or cfg.block_q == 1
            assert tile_words // (32 * cfg.fwd_warps) <= 32 and cfg.fwd_warps <= 16
            assert tile_words // (32 * cfg.bwd_warps) <= 16 and cfg.bwd_warps <= 16
            for backward in (False, True):
                options = cfg.launch_options(backward)
                assert options["maxnreg"] * 32 * options["num_warps"] <= 65536
        for d in (d for d in (1, 7, 100, 1000, 2048, 4096) if d <= triton_backend.max_dim(dtype)):
            for q in (1, 2, 3, 8, 13):
                assert launch.kernel_config(d, q, dtype) in configs


def test_too_wide_rows_are_refused_clearly():
    d = triton_backend.max_dim(torch.float32) + 1
    with pytest.raises(ak.BackendUnavailableError, match="D <="):
        ak.depth_attention(torch.zeros(d), [torch.randn(2, d)], backend="triton")


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("on a GPU machine the tests run Triton for real")
    monkeypatch.setattr(triton_backend, "INTERPRETING", False)
    with pytest.raises(ak.BackendUnavailableError, match="TRITON_INTERPRET"):
        ak.depth_attention(torch.zeros(4), [torch.randn(2, 4)], backend="triton")


# ---------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q,out_norm", [(None, False), (4, True)])
def test_gpu_end_to_end_matches_reference(dtype, q, out_norm):
    sources = [s.cuda() for s in make_sources(9, (4, 512), 1024, dtype)]
    w, g, g_out = (p.cuda() for p in site_params(q, 1024))
    g_out = g_out if out_norm else None
    got = ak.depth_attention(w, sources, g, out_norm_weight=g_out, backend="auto")
    assert ak.ops.resolve_backend("auto", sources[0].device, 1024, dtype) == "triton"
    same = reference.depth_attention(w, sources, g, out_norm_weight=g_out)
    oracle = reference.depth_attention(
        w.double(), [s.double() for s in sources], g.double(), out_norm_weight=g_out.double() if out_norm else None
    )
    assert_close_to_oracle("out", got, same, oracle)


def check_first_call_under_compile():
    """A read and an attention call whose first Triton call in the process is traced by
    torch.compile(fullgraph=True), forward and backward, against the same calls run eagerly after."""
    sources = [s.requires_grad_() for s in make_sources(3, (2, 8), 64, torch.bfloat16)]
    w, g, _ = (p.requires_grad_() for p in site_params(None, 64))
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))

    def loss(w, g, q, k, v, *srcs):
        read = ak.depth_attention(w, list(srcs), g, backend="triton").float().square().sum()
        return read + ak.attention(q, k, v, backend="triton").square().sum()

    inputs = [w, g, q, k, v, *sources]
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs)
    compiled_grads = torch.autograd.grad(compiled, inputs)
    eager = loss(*inputs)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, torch.autograd.grad(eager, inputs)):
        torch.testing.assert_close(got, want)


def test_first_triton_call_can_be_under_torch_compile():
    """The Triton ops are registered at import where they may be used (here the interpreter; a CUDA
    device), so that a model compiled before its first eager call traces them: registered on first
    use, inside the traced code, they broke the graph."""
    run_check_in_subprocess(__name__, "check_first_call_under_compile()", {"TRITON_INTERPRET": "1"})


@pytest.mark.cuda
def test_gpu_compile_fullgraph():
    sources = [s.cuda().requires_grad_() for s in make_sources(5, (2, 64), 256, torch.bfloat16)]
    w, g, _ = (p.cuda().requires_grad_() for p in site_params(None, 256))

    def fn(w, g, *srcs):
        return ak.depth_attention(w, list(srcs), g, backend="triton").float().square().sum()

    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(w, g, *sources), fn(w, g, *sources), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_gpu_one_compiled_kernel_serves_any_count_and_mix():
    """Reads with 1, 3 and 9 sources in different dtype mixes (fp32 output each time) run the
    forward and backward kernels compiled once."""
    from attnres_kernels.triton import depth_attention_kernels as kernels

    w, g, _ = (p.cuda() for p in site_params(None, 256))
    mixes = [
        [torch.float32],
        [torch.float32] + [torch.bfloat16] * 2,
        [torch.bfloat16, torch.float32, torch.float16] * 3,
    ]
    before = {
        k: len(k.device_caches[torch.cuda.current_device()][0])
        for k in (kernels.depth_attn_fwd_kernel, kernels.depth_attn_bwd_kernel)
    }
    for dtypes in mixes:
        sources = [torch.randn(4, 64, 256, device="cuda", dtype=dt).requires_grad_() for dt in dtypes]
        ak.depth_attention(w, sources, g, backend="triton").sum().backward()
    for kernel, count in before.items():
        assert len(kernel.device_caches[torch.cuda.current_device()][0]) - count <= 1


@pytest.mark.cuda
def test_gpu_backward_is_deterministic():
    sources = [s.cuda() for s in make_sources(9, (8, 1024), 2048, torch.bfloat16)]
    w, g, g_out = (p.cuda() for p in site_params(3, 2048))
    first = _run("triton", sources, w, g, g_out)
    second = _run("triton", sources, w, g, g_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
