"""The CUDA fused attention kernels (csrc/cuda/attention_kernels.cuh) on CPU tensors under the
SIMT harness (ATTNRES_CUDA_EMULATE=1), WMMA calls included (csrc/simt/wmma.h): forward and
backward against the reference by FlashAttention's rule, gradcheck, opcheck, determinism.
Every CUDA thread is a fiber: shapes stay small, and the cases of tests/ops/test_attention.py that
need no long sequences are reused with backend="cuda"."""

import itertools

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels.cuda import emulation

# Not collected under these names: called below with backend="cuda".
from tests.ops.test_attention import BAD_CALLS, compare, finite, make_mask, make_qkv, no_kernel  # noqa: F401  (no_kernel: a fixture)
from tests.ops.test_attention import test_bad_input_raises_before_any_kernel as bad_input_case
from tests.ops.test_attention import test_double_backward_is_exact as double_backward_case
from tests.ops.test_attention import test_empty_inputs as empty_inputs_case
from tests.ops.test_attention import test_gradcheck_fp64 as gradcheck_case
from tests.ops.test_attention import test_nan_propagates_like_the_reference as nan_case
from tests.ops.test_attention import test_opcheck as opcheck_case
from tests.ops.test_attention import test_rows_without_keys_are_zero_not_nan as rows_without_keys_case
from tests.support import attnres_ops_called

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
KERNELS = ("attn_fwd", "attn_bwd_rows", "attn_bwd_dkdv", "attn_bwd_dq")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


pytestmark = pytest.mark.usefixtures("cuda_emulation")


def assert_attention_kernels_ran(dtype):
    ran = {launch.kernel for launch in emulation.launch_log()}
    expected = {f"{k}<{DTYPE_NAMES[dtype]}>" for k in KERNELS}
    assert expected <= ran, ran


def _grid():
    """dtype × causal × mask, with T, Dh and the layout cycling (T = 200 once per dtype)."""
    cases = []
    lengths, dims, layouts = (1, 17, 64, 200), (16, 64, 80, 128), ("contiguous", "bthd", "strided")
    for n, (dtype, causal, masked) in enumerate(itertools.product(DTYPES, (True, False), (False, True))):
        t, dh, layout = lengths[(n + n // 4) % 4], dims[(n // 2) % 4], layouts[n % 3]
        case_id = f"{DTYPE_NAMES[dtype]}-{'causal' if causal else 'full'}-{'mask' if masked else 'nomask'}-T{t}-D{dh}"
        cases.append(pytest.param(dtype, causal, masked, t, dh, layout, id=f"{case_id}-{layout}"))
    return cases


@pytest.mark.parametrize("dtype,causal,masked,t,dh,layout", _grid())
def test_matches_reference(dtype, causal, masked, t, dh, layout):
    q, k, v = make_qkv(2, 2, 1, t, t, dh, dtype, layout)
    compare("cuda", q, k, v, causal, make_mask(2, t) if masked else None)
    assert_attention_kernels_ran(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "tq,tk,heads,kv_heads,causal,masked",
    [(17, 64, 4, 1, True, True), (64, 17, 2, 2, True, False), (1, 70, 2, 1, True, True), (70, 1, 2, 2, False, True)],
    ids=["Tq<Tk-gqa4", "Tq>Tk", "one-query", "one-key"],
)
def test_cross_lengths_and_gqa(dtype, tq, tk, heads, kv_heads, causal, masked):
    q, k, v = make_qkv(2, heads, kv_heads, tq, tk, 24, dtype, "bthd")
    mask = make_mask(2, tk).T.contiguous().T if masked else None  # a column-major mask: any strides
    compare("cuda", q, k, v, causal, mask, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_widest_head(dtype):
    """Dh = 256: the plans' smallest tiles (more than 48 KiB of shared memory for fp64)."""
    q, k, v = make_qkv(1, 2, 1, 20, 33, 256, dtype, "strided")
    compare("cuda", q, k, v, True, make_mask(1, 33))


def test_rows_without_keys_are_zero_not_nan():
    rows_without_keys_case("cuda")


@pytest.mark.parametrize("batch,heads,tq,tk", [(2, 2, 0, 5), (2, 2, 5, 0), (0, 2, 3, 3)])
def test_empty_inputs(batch, heads, tq, tk):
    empty_inputs_case("cuda", batch, heads, tq, tk)


def test_nan_propagates_like_the_reference():
    nan_case("cuda")


def test_gradcheck_fp64():
    gradcheck_case("cuda")


def test_double_backward_is_exact():
    double_backward_case("cuda")


@pytest.mark.parametrize("causal,masked", [(True, True), (False, False)])
def test_opcheck(causal, masked):
    opcheck_case("cuda", causal, masked)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bitwise_deterministic_run_to_run(dtype):
    q, k, v = make_qkv(2, 4, 2, 40, 45, 32, dtype, "bthd")
    mask = make_mask(2, 45)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ak.attention(*leaves, key_padding_mask=mask, return_lse=True, backend="cuda")
        gen = torch.Generator().manual_seed(0)
        loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum()
        loss = loss + finite(lse, lse).sum()
        return [out, lse, *torch.autograd.grad(loss, leaves)]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_the_emulated_cuda_kernels_ran():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 9, 9, 16, torch.float16))

    def step():
        torch.autograd.grad(ak.attention(q, k, v, backend="cuda").float().sum(), [q, k, v])

    assert {"attnres_emu::attn_fwd", "attnres_emu::attn_bwd"} <= attnres_ops_called(step)
    assert_attention_kernels_ran(torch.float16)


@pytest.mark.parametrize("make,kwargs,error,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_before_any_kernel(no_kernel, make, kwargs, error, match):  # noqa: F811
    bad_input_case(no_kernel, "cuda", make, kwargs, error, match)
    assert emulation.launch_log() == []


def test_op_checks_its_arguments_before_any_launch():
    """The emulated op called directly (no Python validation) rejects bad input in the
    checks it shares with the CPU op, before any launch."""
    q, k, v = make_qkv(2, 4, 2, 5, 6, 8, torch.float32)
    fwd, bwd = torch.ops.attnres_emu.attn_fwd, torch.ops.attnres_emu.attn_bwd
    with pytest.raises(RuntimeError, match="head size must be in"):
        fwd(*make_qkv(1, 2, 2, 3, 3, 300, torch.float32), None, True, 0.1)
    with pytest.raises(RuntimeError, match="one dtype"):
        fwd(q, k.double(), v, None, True, 0.1)
    with pytest.raises(RuntimeError, match="key_padding_mask must be"):
        fwd(q, k, v, torch.ones(2, 5, dtype=torch.bool), True, 0.1)
    assert emulation.launch_log() == []
    out, lse = fwd(q, k, v, None, True, 0.1)
    emulation.launch_log()
    with pytest.raises(RuntimeError, match="lse must be"):
        bwd(out, None, q, k, v, None, out, lse.double(), True, 0.1)
    with pytest.raises(RuntimeError, match="grad_out and out must be like q"):
        bwd(out[:, :2], None, q, k, v, None, out, lse, True, 0.1)
    assert emulation.launch_log() == []


@pytest.mark.parametrize("causal", [False, True])
def test_forward_traffic_reads_queries_once_and_skips_tiles_above_the_diagonal(causal):
    """Global-memory bytes the harness counted: q read and out / lse written exactly once; each
    query tile reads the keys and values up to its last visible key (whole key tiles of at
    most 64 rows), so under the causal mask far fewer than the full pass."""
    batch, heads, kv_heads, t, dh, size = 1, 2, 1, 200, 32, 2
    q, k, v = make_qkv(batch, heads, kv_heads, t, t, dh, torch.float16)
    ak.attention(q, k, v, causal=causal, backend="cuda")
    (launch,) = [x for x in emulation.launch_log() if x.kernel.startswith("attn_fwd")]
    assert launch.read("q") == q.numel() * size and launch.written("out") == q.numel() * size
    assert launch.written("lse") == batch * heads * t * 4 and launch.traffic["untracked"] == (0, 0)
    tiles = launch.grid[0]
    block_q = next(b for b in (8, 16, 32, 64) if -(-t // b) == tiles)
    row_bytes = dh * size * heads  # every query head reads its kv head's rows
    full = tiles * t * row_bytes
    if not causal:
        assert launch.read("k") == launch.read("v") == full
        return
    last_visible = [min(t, i0 + block_q) for i0 in range(0, t, block_q)]  # Tq = Tk: query i sees keys <= i
    low, high = sum(last_visible) * row_bytes, sum(min(t, e + 63) for e in last_visible) * row_bytes
    assert low <= launch.read("k") == launch.read("v") <= high < full
