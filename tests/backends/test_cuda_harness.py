"""The SIMT harness itself (its emulation of the tensor-core fragment and asynchronous-copy
instructions included), and the mixed-dtype contract
(tests/ops/test_mixed_dtypes.py) for the emulated CUDA backend."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_kernels.cuda import emulation

# Not collected under these names: called below with backend="cuda".
from tests.ops.test_mixed_dtypes import MIXES
from tests.ops.test_mixed_dtypes import test_gradcheck_fp64_with_fp32_sources as mixed_gradcheck
from tests.ops.test_mixed_dtypes import test_mixed_sources_match_the_fp64_oracle as mixed_case

pytestmark = pytest.mark.usefixtures("cuda_emulation")


def _special_values(dtype):
    """Every bit pattern of a 16-bit float as fp32, plus the midpoints between
    neighbours (the round-half-to-even cases) and values just beside them."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).float()
    finite = values[torch.isfinite(values)].unique()
    mid = ((finite[1:].double() + finite[:-1].double()) / 2).float()
    nudge = torch.cat([torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    huge = torch.tensor([1e30, -1e30, 65504.0, 65519.99, 65520.0, 3.39e38, float("inf"), -float("inf")])
    return torch.cat([values, mid, nudge, huge])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_to_16_bit_rounding_matches_torch(dtype):
    x = _special_values(dtype)
    got = torch.ops.attnres_emu.round_to(x, dtype)
    want = x.to(dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert same.all(), x[~same][:10]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy's reference, for the huge values
def test_fp64_to_fp16_rounds_once():
    """Straight from double (like CUDA's __double2half), not through float: numpy's
    double -> half conversion is the correctly rounded reference."""
    x = torch.cat([_special_values(torch.float16).double(), torch.randn(10000, dtype=torch.float64) * 100])
    x = torch.cat([x, x * (1 + 2.0**-30)])  # off the float grid: a double rounding would show
    got = torch.ops.attnres_emu.round_to(x, torch.float16)
    want = torch.from_numpy(x.numpy().astype(np.float16))
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert same.all(), x[~same][:10]


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("q,out_norm,merge", [(None, False, False), (3, True, False), (None, True, True)])
def test_mixed_sources_match_the_fp64_oracle(mix, q, out_norm, merge):
    mixed_case("cuda", mix, q, out_norm, merge)


@pytest.mark.parametrize("out_norm", [False, True])
def test_mixed_gradcheck_fp64_with_fp32_sources(out_norm):
    mixed_gradcheck("cuda", out_norm)


# ---------------------------------------------------------------- fragment instructions (csrc/simt/warp_matrix.h)
# Each emulated instruction against a plain matrix product or copy; the expected fragment
# layouts are the PTX ISA's tables, written out here independently of the emulation.


def _fp32_sum_bound(c, a, b):
    """How far an fp32 sum of exact products c + a · b may be from the exact value."""
    k = a.shape[1]
    return (k + 1) * 2.0**-24 * (c.double().abs() + a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_m16n8k16_matches_a_matmul(dtype):
    """mma.sync.m16n8k16 with each lane's A, B, C fragments gathered by the PTX tables."""
    a, b, c = torch.randn(16, 16).to(dtype), torch.randn(16, 8).to(dtype), torch.randn(16, 8)
    got = torch.ops.attnres_emu.mma_tile(a, b, c)
    want = c.double() + a.double() @ b.double()
    assert bool(((got.double() - want).abs() <= _fp32_sum_bound(c, a, b)).all())


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_matches_the_fragment_table(count, trans):
    """ldmatrix.x{1,2,4}[.trans]: register i of lane l holds row l / 4, columns 2 (l % 4) and
    2 (l % 4) + 1 of matrix i (.trans: the transpose), low half first; each lane's row address
    is honoured (the rows sit in shared memory in reverse order)."""
    m = torch.randint(-(2**15), 2**15, (8 * count, 8), dtype=torch.int32).to(torch.int16)
    got = torch.ops.attnres_emu.ldmatrix_copy(m, count, trans)
    bits = m.to(torch.int32) & 0xFFFF
    want = torch.empty(32, count, dtype=torch.int64)
    for lane in range(32):
        r, c = lane // 4, 2 * (lane % 4)
        for i in range(count):
            lo, hi = (
                (bits[8 * i + c, r], bits[8 * i + c + 1, r]) if trans else (bits[8 * i + r, c], bits[8 * i + r, c + 1])
            )
            want[lane, i] = int(lo) | int(hi) << 16
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_ldmatrix_and_mma_make_a_matmul(dtype, b_transposed):
    """c + a · b by ldmatrix.x4 (A), ldmatrix.x2 from b's transpose or .x2.trans from b, and
    mma.sync, one warp per 16 x 8 tile, against an fp64 matmul within the fp32 sum's bound."""
    m, n, k = 48, 40, 64
    a, b, c = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype), torch.randn(m, n)
    got = torch.ops.attnres_emu.mma_matmul(a, b.T.contiguous() if b_transposed else b, c, b_transposed, 0)
    want = c.double() + a.double() @ b.double()
    assert got.dtype == torch.float32 and bool(((got.double() - want).abs() <= _fp32_sum_bound(c, a, b)).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_operands_widen_exactly(dtype):
    """Every finite 16-bit value (subnormals included) times the identity comes back as itself."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[torch.isfinite(values)]
    values = values[: values.numel() // 256 * 256].reshape(-1, 16)
    eye = torch.eye(16).to(dtype)
    for half in (eye[:, :8], eye[:, 8:]):
        got = torch.ops.attnres_emu.mma_matmul(values, half.contiguous(), torch.zeros(values.shape[0], 8), False, 0)
        assert torch.equal(got, values.float() @ half.float())


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_cp_async_copies_and_zero_fills(chunk):
    """cp.async of 4, 8 and 16 bytes, every third chunk zero-filled (no source bytes), waited for."""
    src = torch.randint(0, 256, (64 * chunk,), dtype=torch.uint8)
    got = torch.ops.attnres_emu.cp_async_copy(src, chunk, 3, 0)
    want = src.clone().view(64, chunk)
    want[2::3] = 0
    assert torch.equal(got, want.view(-1))


def test_cp_async_lands_at_the_wait():
    """A copy lands when a wait retires its group: read before any wait, shared memory still holds
    its poison (0xFF bytes); after cp.async.wait_group 1, the older group has landed and the newer
    one not yet; with copies landing when issued, everything is there before any wait."""
    src = torch.randint(0, 255, (32 * 16,), dtype=torch.uint8)  # no 0xFF byte
    assert bool((torch.ops.attnres_emu.cp_async_copy(src, 16, 0, 1) == 255).all())
    got = torch.ops.attnres_emu.cp_async_copy(src, 16, 0, 2).view(32, 16)
    assert torch.equal(got[0::2], src.view(32, 16)[0::2]) and bool((got[1::2] == 255).all())
    previous = torch.ops.attnres_emu.set_cp_async_eager(True)
    try:
        assert torch.equal(torch.ops.attnres_emu.cp_async_copy(src, 16, 0, 1), src)
    finally:
        torch.ops.attnres_emu.set_cp_async_eager(previous)


def test_a_lane_that_skips_a_warp_instruction_deadlocks():
    """ldmatrix and mma.sync are warp-collective: a lane that does not execute them leaves the
    rest of its warp waiting, which the scheduler reports."""
    a, b = torch.randn(16, 16).half(), torch.randn(16, 8).half()
    with pytest.raises(RuntimeError, match="deadlock"):
        torch.ops.attnres_emu.mma_matmul(a, b, torch.zeros(16, 8), False, 2)


def test_ldmatrix_outside_shared_memory_is_reported():
    """A lane passing an ldmatrix row address outside the dynamic shared memory: reported, and
    the process aborts (like the harness's other misuse checks), so this runs in a subprocess."""
    code = (
        "import torch; from attnres_kernels.cuda import emulation; assert emulation.load() is None; "
        "torch.ops.attnres_emu.mma_matmul(torch.randn(16, 16).half(), torch.randn(16, 8).half(), "
        "torch.zeros(16, 8), False, 1)"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, emulation.ENV: "1", "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ldmatrix: a row address outside the dynamic shared memory" in result.stderr
