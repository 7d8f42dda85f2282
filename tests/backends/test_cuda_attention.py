"""The CUDA fused attention kernels (csrc/cuda/attention_kernels.cuh) on CPU tensors under the
SIMT harness (ATTNRES_CUDA_EMULATE=1): the fp16 / bf16 tensor-core kernels with their mma.sync,
ldmatrix and cp.async emulated per lane (csrc/simt/warp_matrix.h), the fp32 / fp64 SIMT kernels;
forward and backward against the reference by FlashAttention's rule, every head-size bucket and
the smaller plans of GPUs with less shared memory, gradcheck, opcheck, determinism, and the
global-memory bytes each launch moves. Every CUDA thread is a fiber: shapes stay small, and the
cases of tests/ops/test_attention.py that need no long sequences are reused with backend="cuda"."""

import itertools

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
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
TENSOR_CORE_DTYPES = [torch.float16, torch.bfloat16]
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
# The opt-in shared memory per block of sm_86 / sm_89, sm_80 (the harness's default) and sm_90.
SHARED_SM86, SHARED_SM80, SHARED_SM90 = 99 * 1024, 163 * 1024, 227 * 1024


pytestmark = pytest.mark.usefixtures("cuda_emulation")


def kernel_names(dtype, dh):
    """The launch names of the forward and backward kernels for ``dtype`` and head size ``dh``:
    tensor-core kernels per head-size bucket of 32 for fp16 / bf16, SIMT kernels otherwise."""
    name = DTYPE_NAMES[dtype]
    if dtype in TENSOR_CORE_DTYPES:
        bucket = -(-dh // 32) * 32
        return {
            "fwd": f"attn_fwd_mma<{name}, {bucket}>",
            "rows": f"attn_bwd_rows<{name}>",
            "dkdv": f"attn_bwd_dkdv_mma<{name}, {bucket}>",
            "dq": f"attn_bwd_dq_mma<{name}, {bucket}>",
        }
    return {
        "fwd": f"attn_fwd_simt<{name}>",
        "rows": f"attn_bwd_rows<{name}>",
        "dkdv": f"attn_bwd_dkdv_simt<{name}>",
        "dq": f"attn_bwd_dq_simt<{name}>",
    }


def assert_attention_kernels_ran(dtype, dh):
    ran = {launch.kernel for launch in emulation.launch_log()}
    expected = set(kernel_names(dtype, dh).values())
    assert expected <= ran, ran


@pytest.fixture
def shared_memory_limit(cuda_emulation):
    """Sets the shared memory per block the launch plans assume (restored after the test)."""
    previous = []

    def set_limit(nbytes):
        previous.append(torch.ops.attnres_emu.set_shared_memory_limit(nbytes))

    yield set_limit
    if previous:
        torch.ops.attnres_emu.set_shared_memory_limit(previous[0])


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
    assert_attention_kernels_ran(dtype, dh)


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
    assert_attention_kernels_ran(torch.float16, 16)


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


# ---------------------------------------------------------------- the tensor-core kernels


@pytest.mark.parametrize("dtype", TENSOR_CORE_DTYPES)
@pytest.mark.parametrize(
    "dh,layout",
    [(8, "contiguous"), (24, "bthd"), (40, "contiguous"), (96, "bthd"), (136, "contiguous"), (160, "bthd")]
    + [(192, "contiguous"), (200, "bthd"), (250, "contiguous"), (256, "bthd"), (64, "strided"), (33, "strided")],
)
def test_every_head_size_bucket(dtype, dh, layout):
    """Each head-size bucket of the tensor-core kernels (32 to 256; past 128 two warps share
    the keys of the dK/dV kernel), head sizes inside a bucket (zero-padded columns), and views
    whose rows are no 16-byte chunks (Dh not a multiple of 8, strided: read element by element);
    causal with Tq < Tk, key padding and grouped-query heads."""
    q, k, v = make_qkv(2, 4, 2, 21, 38, dh, dtype, layout)
    compare("cuda", q, k, v, True, make_mask(2, 38))
    assert_attention_kernels_ran(dtype, dh)


@pytest.mark.parametrize("dtype", TENSOR_CORE_DTYPES)
@pytest.mark.parametrize(
    "tq,tk,causal,masked",
    [(150, 150, True, False), (70, 200, True, True), (200, 70, True, False), (130, 300, False, True)],
    ids=["causal", "Tq<Tk-mask", "Tq>Tk", "full-mask"],
)
def test_many_tiles(dtype, tq, tk, causal, masked):
    """Several query and key tiles per block, so the double-buffered walks prefetch, wrap
    around their buffers and skip the tiles above the diagonal (Tq > Tk: the first rows see no key)."""
    q, k, v = make_qkv(1, 2, 1, tq, tk, 64, dtype, "bthd")
    compare("cuda", q, k, v, causal, make_mask(1, tk) if masked else None)


def _mma_shared_bytes(kernel, dh, warps, stages):
    """Dynamic shared memory of a tensor-core kernel (the layouts of attention_mma_kernels.cuh,
    each piece rounded up to 32 bytes): the block's own rows once, the walked tiles per stage."""
    d = -(-dh // 32) * 32
    keys, queries, split = (64 if d <= 128 else 32), (64 if d <= 64 else 32), (1 if d <= 128 else 2)

    def piece(n):
        return -(-n // 32) * 32

    if kernel == "fwd":
        return piece(warps * 16 * d * 2) + piece(stages * 2 * keys * d * 2) + piece(stages * keys)
    if kernel == "dq":
        return 2 * piece(warps * 16 * d * 2) + piece(stages * 2 * keys * d * 2) + piece(stages * keys)
    return (
        2 * piece(warps // split * 16 * d * 2) + piece(stages * 2 * queries * d * 2) + piece(stages * 2 * queries * 4)
    )


@pytest.mark.parametrize(
    "limit,dh,plans",
    [
        # kernel: (warps, walked tiles in flight)
        (SHARED_SM90, 256, {"fwd": (8, 2), "dkdv": (8, 2), "dq": (8, 2)}),
        (SHARED_SM80, 256, {"fwd": (8, 2), "dkdv": (8, 2), "dq": (8, 1)}),
        (SHARED_SM86, 256, {"fwd": (8, 1), "dkdv": (8, 1), "dq": (4, 1)}),
        (SHARED_SM86, 128, {"fwd": (8, 2), "dkdv": (8, 2), "dq": (8, 1)}),
    ],
    ids=["sm90-D256", "sm80-D256", "sm86-D256", "sm86-D128"],
)
def test_plans_follow_the_shared_memory(shared_memory_limit, limit, dh, plans):
    """The launch plans of a GPU with less shared memory per block (sm_86/89: 99 KiB) give the
    walked tiles one buffer instead of two, then 4 warps instead of 8; each plan fits and computes
    the same attention."""
    shared_memory_limit(limit)
    q, k, v = make_qkv(1, 2, 1, 40, 70, dh, torch.bfloat16, "contiguous")
    compare("cuda", q, k, v, True, make_mask(1, 70))
    launches = {x.kernel: x for x in emulation.launch_log()}
    names = kernel_names(torch.bfloat16, dh)
    for kernel, (warps, stages) in plans.items():
        launch = launches[names[kernel]]
        assert launch.block == (warps * 32, 1, 1), (kernel, launch)
        assert launch.shared_bytes == _mma_shared_bytes(kernel, dh, warps, stages) <= limit, (kernel, launch)


@pytest.fixture
def copies_land_when_issued(cuda_emulation):
    """cp.async copies land when issued instead of when waited for (restored after the test)."""
    previous = torch.ops.attnres_emu.set_cp_async_eager(True)
    yield
    torch.ops.attnres_emu.set_cp_async_eager(previous)


@pytest.mark.parametrize("limit", [SHARED_SM80, SHARED_SM86], ids=["two-stages", "one-stage"])
@pytest.mark.parametrize("tq,tk", [(150, 150), (200, 70)])
def test_copies_landing_as_soon_as_issued(copies_land_when_issued, shared_memory_limit, limit, tq, tk):
    """The GPU may land an asynchronous copy anywhere between its issue and its wait: the
    harness lands them at the wait by default (a read before it sees stale data) and here at
    the issue (a copy into a buffer that another warp still reads corrupts it): the pipelines
    are right both ways, with the walked tiles double- and single-buffered."""
    shared_memory_limit(limit)
    q, k, v = make_qkv(1, 2, 1, tq, tk, 128, torch.float16, "bthd")
    compare("cuda", q, k, v, True, make_mask(1, tk))


@pytest.mark.parametrize("dtype", TENSOR_CORE_DTYPES)
def test_tensor_core_rows_without_keys_are_zero_not_nan(dtype):
    """Tq > Tk under causal (rows 0-2 see no key) and a batch whose keys are all padding: out 0,
    lse -inf and zero gradients, never NaN, in the 16-bit kernels too."""
    q, k, v = make_qkv(2, 2, 1, 7, 4, 16, dtype)
    mask = torch.tensor([[True, False, True, True], [False] * 4])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ak.attention(q, k, v, key_padding_mask=mask, return_lse=True, backend="cuda")
    grads = torch.autograd.grad(out.float().sum() + finite(lse, lse).sum(), [q, k, v])
    no_key = torch.zeros(2, 2, 7, dtype=torch.bool)
    no_key[0, :, :3] = True
    no_key[1] = True
    assert torch.equal(lse == -float("inf"), no_key)
    assert bool((out[no_key] == 0).all()) and bool((grads[0][no_key] == 0).all())
    assert bool((grads[1][1] == 0).all()) and bool((grads[2][1] == 0).all())
    assert all(bool(torch.isfinite(t).all()) for t in (out, *grads))
    assert_attention_kernels_ran(dtype, 16)


@pytest.mark.parametrize("dtype", TENSOR_CORE_DTYPES)
def test_tensor_core_nan_propagates_like_the_reference(dtype):
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, dtype)
    q[0, 0, 4, 3] = float("nan")  # one query row
    k[0, 1, 6, 0] = float("nan")  # one key: every later row of head 1 reads it
    out = ak.attention(q, k, v, causal=True, backend="cuda")
    expected = reference.attention(q.float(), k.float(), v.float(), causal=True)
    assert torch.equal(torch.isnan(out), torch.isnan(expected)) and bool(torch.isnan(out).any())


# ---------------------------------------------------------------- global-memory traffic


def _key_rows_read(tq, tk, block_q, block_k, causal):
    """Key rows a walk over key tiles of ``block_k`` reads for each ``block_q``-row query tile:
    up to the last key the tile's last query sees (whole tiles, but no row past Tk)."""
    rows = 0
    for i0 in range(0, tq, block_q):
        end = min(tk, i0 + block_q + tk - tq) if causal else tk
        rows += min(tk, -(-max(end, 0) // block_k) * block_k)
    return rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_traffic_reads_queries_once_and_skips_tiles_above_the_diagonal(dtype, causal):
    """Global-memory bytes the harness counted against the I/O floor (q, k, v read once, out
    and lse written once): q read and out / lse written exactly once; each query tile reads the
    keys and values up to its last visible key, so under the causal mask far fewer than the
    full pass. Tensor cores: 128-row query tiles, 64-key tiles; SIMT: 64 x 64."""
    batch, heads, kv_heads, t, dh = 1, 2, 1, 300, 32
    size = torch.finfo(dtype).bits // 8
    q, k, v = make_qkv(batch, heads, kv_heads, t, t, dh, dtype)
    ak.attention(q, k, v, causal=causal, backend="cuda")
    (launch,) = [x for x in emulation.launch_log() if x.kernel.startswith("attn_fwd")]
    assert launch.read("q") == q.numel() * size and launch.written("out") == q.numel() * size
    assert launch.written("lse") == batch * heads * t * 4 and launch.traffic["untracked"] == (0, 0)
    block_q = 128 if dtype == torch.float16 else 64
    assert launch.grid == (-(-t // block_q), heads, batch)
    row_bytes = dh * size * heads  # every query head reads its kv head's rows
    key_rows = _key_rows_read(t, t, block_q, 64, causal)
    assert launch.read("k") == launch.read("v") == key_rows * row_bytes
    floor = 2 * q.numel() * size + 2 * k.numel() * size + batch * heads * t * 4
    total = sum(r + w for r, w in launch.traffic.values())
    assert total == floor + 2 * (key_rows * row_bytes - k.numel() * size)
    if causal:
        assert key_rows < -(-t // block_q) * t


@pytest.mark.parametrize("causal", [False, True])
def test_backward_traffic(causal):
    """The tensor-core backward: the row terms read dO and O once; the dK/dV kernel reads K and V
    once and, per 128-key block, the q / dO tiles of every head of its group that see the block
    (causal: from the diagonal on); the dQ kernel reads q and dO once and, per 128-query block, the
    key tiles it sees; each gradient is written exactly once. GQA 2:1 with Tq != Tk."""
    batch, heads, kv_heads, tq, tk, dh, size = 1, 4, 2, 150, 300, 32, 2
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, heads, kv_heads, tq, tk, dh, torch.float16))
    out = ak.attention(q, k, v, causal=causal, backend="cuda")
    emulation.launch_log()
    torch.autograd.grad(out.float().sum(), [q, k, v])
    launches = {x.kernel.split("<")[0]: x for x in emulation.launch_log()}
    rows, dkdv, dq = launches["attn_bwd_rows"], launches["attn_bwd_dkdv_mma"], launches["attn_bwd_dq_mma"]
    q_bytes, k_bytes = q.numel() * size, k.numel() * size
    assert rows.read("grad_out") == rows.read("out") == q_bytes
    assert dkdv.read("k") == dkdv.read("v") == k_bytes and dkdv.written("grad_k") == dkdv.written("grad_v") == k_bytes
    # Query rows each 128-key block reads (per head): from the first query that sees its first key.
    query_rows = 0
    for j0 in range(0, tk, 128):
        first = max(0, j0 - (tk - tq)) if causal else 0
        query_rows += tq - first // 64 * 64 if first < tq else 0
    row_bytes = dh * size * heads  # every head of each group
    assert dkdv.read("q") == dkdv.read("grad_out") == query_rows * row_bytes
    assert dkdv.read("lse_log2") == dkdv.read("delta") == query_rows * heads * 4
    assert dq.read("q") == dq.read("grad_out") == q_bytes and dq.written("grad_q") == q_bytes
    key_rows = _key_rows_read(tq, tk, 128, 64, causal)
    assert dq.read("k") == dq.read("v") == key_rows * dh * size * heads
    assert all(x.traffic["untracked"] == (0, 0) for x in (rows, dkdv, dq))
