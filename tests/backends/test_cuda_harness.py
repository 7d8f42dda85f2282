"""The SIMT harness itself (its WMMA emulation included), and the mixed-dtype contract
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


# ---------------------------------------------------------------- the WMMA emulation (csrc/simt/wmma.h)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_transposed", [False, True])
def test_wmma_matches_a_matmul(dtype, b_transposed):
    """c + a · b by 16 x 16 x 16 fragments (b row-major, or col-major: stored transposed)
    against an fp64 matmul, within the bound of an fp32 sum of exact products."""
    m, n, k = 48, 64, 80
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    c = torch.randn(m, n)
    got = torch.ops.attnres_emu.wmma_matmul(a, b.T.contiguous() if b_transposed else b, c, b_transposed, 0)
    want = c.double() + a.double() @ b.double()
    bound = (k + 1) * 2.0**-24 * (c.double().abs() + a.double().abs() @ b.double().abs())
    assert got.dtype == torch.float32 and bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wmma_operands_widen_exactly(dtype):
    """Every finite 16-bit value (subnormals included) times the identity comes back as itself."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[torch.isfinite(values)]
    values = values[: values.numel() // 256 * 256].reshape(-1, 16)
    eye = torch.eye(16).to(dtype)
    got = torch.ops.attnres_emu.wmma_matmul(values, eye, torch.zeros(values.shape[0], 16), False, 0)
    assert torch.equal(got, values.float())


def test_wmma_lane_that_skips_a_call_deadlocks():
    """Warp-collective like the real API: a lane that does not call load/mma/store
    leaves the rest of its warp waiting, which the scheduler reports."""
    a, b = torch.randn(16, 16).half(), torch.randn(16, 16).half()
    with pytest.raises(RuntimeError, match="deadlock"):
        torch.ops.attnres_emu.wmma_matmul(a, b, torch.zeros(16, 16), False, 2)


def test_wmma_lanes_with_different_pointers_are_reported():
    """Lanes passing different pointers to load_matrix_sync: reported, and the process aborts
    (like the harness's other misuse checks), so this runs in a subprocess."""
    code = (
        "import torch; from attnres_kernels.cuda import emulation; assert emulation.load() is None; "
        "a = torch.randn(32, 16).half(); "
        "torch.ops.attnres_emu.wmma_matmul(a, torch.randn(16, 16).half(), torch.zeros(32, 16), False, 1)"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, emulation.ENV: "1", "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "wmma misuse: load_matrix_sync: the lanes passed different pointers" in result.stderr
