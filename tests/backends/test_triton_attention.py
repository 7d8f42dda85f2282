"""The Triton attention kernels against the reference (interpreter on CPU; real GPU where marked ``cuda``).

Under the interpreter every program runs in numpy, one at a time: shapes stay tiny.
Comparisons run with the dispatcher's tiles (every dtype) and with small tiles
(16/32 rows; fp16 and fp64) that make the kernels loop over several key and
query tiles, so that the split between fully visible tiles and masked
(diagonal, ragged) tiles is exercised.
"""

import importlib

import pytest
import torch

import attnres_kernels as ak
import attnres_kernels.triton as triton_backend
from tests.support import assert_close_to_oracle, attnres_ops_called

pytestmark = pytest.mark.skipif(triton_backend.IMPORT_ERROR is not None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

# (B, H, Hkv, Tq, Tk, Dh, causal, key padding)
CASES = [
    pytest.param(2, 2, 2, 17, 17, 16, True, False, id="causal-T17"),
    pytest.param(1, 4, 2, 17, 17, 80, False, True, id="gqa-padded-Dh80"),
    pytest.param(2, 2, 1, 1, 17, 16, True, True, id="decode-Tq1<Tk-mqa"),
    pytest.param(2, 2, 2, 17, 5, 16, True, True, id="Tq>Tk-rows-without-keys"),
    pytest.param(1, 2, 1, 64, 64, 16, True, True, id="causal-T64-padded"),
    pytest.param(1, 1, 1, 5, 33, 80, True, False, id="chunk-Tq<Tk-Dh80"),
]


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fresh tensors from ``Tensor.new_empty`` (what the launchers allocate outputs,
    ``lse``, ``delta`` and gradients with) start as NaN: any element a kernel fails
    to write shows up in the comparison."""
    original = torch.Tensor.new_empty

    def new_empty_nan(self, *args, **kwargs):
        t = original(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty_nan)


@pytest.fixture(params=["dispatcher", "small"])
def tiles(request, monkeypatch):
    """The dispatcher's tiles, or 16/32-row tiles (several tiles per head even at T = 17)."""
    if request.param == "small":
        from attnres_kernels.triton import attention_ops as launch

        dispatcher = launch.kernel_config

        def small_tiles(head_dim, dtype):
            cfg = dispatcher(head_dim, dtype)
            return launch.AttentionConfig(
                cfg.block_d, launch.Tiles(16, 32, 1, 1), launch.Tiles(32, 16, 1, 1), launch.Tiles(16, 16, 1, 1)
            )

        monkeypatch.setattr(launch, "kernel_config", small_tiles)
    return request.param


def make_inputs(b, h, hkv, tq, tk, dh, dtype, padded):
    """q, k, v in the layouts a model produces (q from ``[B, T, H, Dh]``, k and v halves of
    one ``[B, T, 2, Hkv, Dh]`` projection: no tensor is contiguous) and a key padding mask
    (a ``[Tk, B]`` transpose) whose first batch row also pads keys inside the causal window."""
    q = torch.randn(b, tq, h, dh, dtype=torch.float64, device=DEVICE).transpose(1, 2)
    kv = torch.randn(b, tk, 2, hkv, dh, dtype=torch.float64, device=DEVICE)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    mask = None
    if padded:
        mask = (torch.rand(tk, b, device=DEVICE) > 0.3).t()
        mask[0, : min(tk, 3)] = False  # the first query rows of batch 0 then see no key
        mask[-1, -1] = True
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def run_attention(backend, q, k, v, mask, causal, weights):
    """``out``, ``lse`` and the gradients of ``<out, w_out> + <lse, w_lse>`` w.r.t. q, k, v.
    ``w_lse`` is nonzero on every row, those that see no key included (their lse is
    constant -inf: the gradient must ignore it)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ak.attention(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True, backend=backend)
    w_out, w_lse = weights
    grads = torch.autograd.grad([out, lse], [q, k, v], [w_out.to(out.dtype), w_lse.to(lse.dtype)])
    return [out, lse, *grads]


def random_weights(q):
    """Cotangents of out (non-contiguous) and lse."""
    b, h, tq, dh = q.shape
    w_out = torch.randn(b, tq, h, dh, dtype=torch.float64, device=q.device).transpose(1, 2)
    return w_out, torch.randn(b, h, tq, dtype=torch.float64, device=q.device)


def assert_lse_close(actual, same, oracle):
    """``lse`` is -inf exactly where the oracle's is; elsewhere the 3x rule."""
    no_key = oracle.isinf()
    assert torch.equal(actual.isinf(), no_key) and (oracle[no_key] < 0).all()
    finite = lambda t: t.masked_fill(no_key, 0.0)
    assert_close_to_oracle("lse", finite(actual), finite(same), finite(oracle))


TILES_AND_DTYPES = [("dispatcher", dtype) for dtype in DTYPES] + [("small", torch.float16), ("small", torch.float64)]


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("tiles,dtype", TILES_AND_DTYPES, indirect=["tiles"], ids=str)
@pytest.mark.parametrize("b,h,hkv,tq,tk,dh,causal,padded", CASES)
def test_matches_reference(tiles, dtype, b, h, hkv, tq, tk, dh, causal, padded):
    """Forward and all gradients vs the fp64 oracle, with FlashAttention's error rule
    against a same-precision reference run; every output element written."""
    q, k, v, mask = make_inputs(b, h, hkv, tq, tk, dh, dtype, padded)
    weights = random_weights(q)
    got = run_attention("triton", q, k, v, mask, causal, weights)
    same = run_attention("reference", q, k, v, mask, causal, weights)
    oracle = run_attention("reference", q.double(), k.double(), v.double(), mask, causal, weights)
    for t in got:
        assert not t.isnan().any()
    assert [t.dtype for t in got] == [q.dtype, same[1].dtype, q.dtype, k.dtype, v.dtype]
    assert_lse_close(got[1], same[1], oracle[1])
    for name, a, s, o in zip(
        ("out", "dq", "dk", "dv"), got[:1] + got[2:], same[:1] + same[2:], oracle[:1] + oracle[2:]
    ):
        assert_close_to_oracle(name, a, s, o)


@pytest.mark.usefixtures("poisoned_allocations")
def test_rows_that_see_no_key_are_zero(tiles):
    """Padded keys and the bottom-right causal mask (Tq > Tk) leave rows without keys:
    out 0, lse -inf, zero gradients, never NaN, even with a grad_lse on those rows."""
    q, k, v, _ = make_inputs(2, 2, 1, 20, 6, 16, torch.float32, False)
    mask = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    mask[1] = False  # batch 1: no key at all
    out, lse, dq, dk, dv = run_attention("triton", q, k, v, mask, True, random_weights(q))
    no_key = torch.zeros(2, 2, 20, dtype=torch.bool, device=DEVICE)
    no_key[0, :, :14] = True  # query i sees keys j <= i - 14
    no_key[1] = True
    assert torch.equal(lse == float("-inf"), no_key)
    assert (out[no_key] == 0).all() and (dq[no_key] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert not any(t.isnan().any() for t in (out, lse, dq, dk, dv))
    assert (out[~no_key] != 0).any()


def test_nan_propagates_like_the_reference():
    """A NaN in a query row or in a key reaches exactly the outputs it reaches in PyTorch."""
    q, k, v, mask = make_inputs(1, 2, 1, 9, 9, 16, torch.float32, True)
    q[0, 1, 4, 3] = float("nan")  # row 4 sees the real key 3
    k[0, 0, 5, 1] = float("nan")  # seen by the query rows >= 5 of both heads (GQA)
    mask[0, 3:6] = True
    got = ak.attention(q, k, v, key_padding_mask=mask, return_lse=True, backend="triton")
    want = ak.attention(q, k, v, key_padding_mask=mask, return_lse=True, backend="reference")
    for a, b in zip(got, want):
        assert b.isnan().any() and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize(
    "causal,padded,shape", [(True, True, (1, 4, 2, 9, 12, 16)), (False, False, (1, 2, 1, 7, 5, 80))]
)
def test_gradcheck_fp64_through_the_kernels(tiles, causal, padded, shape):
    """fp64 gradcheck of q, k, v through the real kernels (fp64 accumulators and dots)."""
    q, k, v, mask = make_inputs(*shape, torch.float64, padded)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        out, lse = ak.attention(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True, backend="triton")
        return out, torch.where(lse.isinf(), 0.0, lse)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def _op_samples():
    """Argument tuples of ``attn_fwd``: GQA with Tq < Tk and a mask (fp64, grads required);
    Tq > Tk without mask, non-causal, q not contiguous (fp32)."""
    q = torch.randn(2, 4, 5, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 7, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 7, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 7) > 0.3
    q32 = torch.randn(1, 2, 16, 9).transpose(2, 3)
    kv32 = torch.randn(1, 2, 4, 16)
    return [(q, k, v, mask, True, 0.25), (q32, kv32, kv32, None, False, 0.3)]


def test_opcheck():
    """Schema, fake kernels and autograd registration of the Triton attention ops."""
    ak.ops._dispatch.triton_ops()  # defines the attnres_triton:: ops and registers their fakes and autograd
    for args in _op_samples():
        torch.library.opcheck(torch.ops.attnres_triton.attn_fwd.default, args)
    q, k, v, mask, causal, scale = (t.detach() if isinstance(t, torch.Tensor) else t for t in _op_samples()[0])
    out, lse = torch.ops.attnres_triton.attn_fwd(q, k, v, mask, causal, scale)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    for dlse in (grad_lse, None):
        args = (grad_out, dlse, q, k, v, mask, out, lse, causal, scale)
        torch.library.opcheck(torch.ops.attnres_triton.attn_bwd.default, args)


def test_triton_kernels_are_launched(monkeypatch):
    """The Triton ops run (profiler) and each kernel launches once per call: a fallback
    to the reference could not produce these counts."""
    from attnres_kernels.triton import attention_ops as launch

    launches = {}

    class Spy:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launches[self.name] = launches.get(self.name, 0) + 1
            return self.kernel[grid]

    names = ("attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")
    for name in names:
        monkeypatch.setattr(launch, name, Spy(getattr(launch, name), name))
    q, k, v, mask = (
        t.requires_grad_() if t.is_floating_point() else t for t in make_inputs(1, 2, 1, 9, 9, 16, torch.float32, True)
    )
    ops = attnres_ops_called(lambda: ak.attention(q, k, v, key_padding_mask=mask, backend="triton").sum().backward())
    assert {"attnres_triton::attn_fwd", "attnres_triton::attn_bwd"} <= ops
    assert launches == dict.fromkeys(names, 1)


def test_dispatcher_covers_every_head_size():
    """Every head size maps to one of the configurations the AOT check compiles."""
    from attnres_kernels.triton import attention_ops as launch

    for dtype in DTYPES:
        configs = launch.all_kernel_configs(dtype)
        for dh in range(1, launch.max_head_dim(dtype) + 1):
            cfg = launch.kernel_config(dh, dtype)
            assert cfg in configs and dh <= cfg.block_d and (cfg.block_d < 2 * dh or cfg.block_d == launch.MIN_BLOCK_D)
        aot = {(x.name, x.config) for x in launch.aot_launches(dtype)}
        assert len(aot) == 3 * len(configs) + 1  # fwd, dK/dV, dQ per configuration; one delta kernel


def test_too_large_head_size_is_refused_clearly():
    q = torch.randn(1, 1, 2, 257, device=DEVICE)
    with pytest.raises(ak.BackendUnavailableError, match="Dh <= 256"):
        ak.attention(q, q, q, backend="triton")
    q = torch.randn(1, 1, 2, 129, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="Dh <= 128 for torch.float64"):
        ak.attention(q, q, q, backend="triton")


# ---------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dh", [64, 128, 80])
def test_gpu_end_to_end_matches_reference(dtype, dh):
    q, k, v, mask = make_inputs(2, 8, 2, 1000, 1100, dh, dtype, True)
    weights = random_weights(q)
    attention_ops = importlib.import_module("attnres_kernels.ops.attention")
    # A key padding mask can leave rows without keys, which SDPA cannot express: "auto" runs our kernels.
    assert attention_ops.resolve_backend("auto", q, k, key_padding_mask=mask) == "triton"
    got = run_attention("auto", q, k, v, mask, True, weights)
    same = run_attention("reference", q, k, v, mask, True, weights)
    oracle = run_attention("reference", q.double(), k.double(), v.double(), mask, True, weights)
    assert_lse_close(got[1], same[1], oracle[1])
    for name, a, s, o in zip(
        ("out", "dq", "dk", "dv"), got[:1] + got[2:], same[:1] + same[2:], oracle[:1] + oracle[2:]
    ):
        assert_close_to_oracle(name, a, s, o)


@pytest.mark.cuda
def test_gpu_backward_is_deterministic():
    q, k, v, mask = make_inputs(2, 8, 2, 1024, 1024, 128, torch.bfloat16, True)
    weights = random_weights(q)
    first = run_attention("triton", q, k, v, mask, True, weights)
    second = run_attention("triton", q, k, v, mask, True, weights)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
