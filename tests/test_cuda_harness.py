"""The SIMT harness itself, and the mixed-dtype contract (tests/test_mixed_dtypes.py) for the
emulated CUDA backend."""

import numpy as np
import pytest
import torch

# Not collected under these names: called below with backend="cuda".
from test_mixed_dtypes import MIXES
from test_mixed_dtypes import test_gradcheck_fp64_with_fp32_sources as mixed_gradcheck
from test_mixed_dtypes import test_mixed_sources_match_the_fp64_oracle as mixed_case

from attnres_kernels.cuda import emulation


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setenv(emulation.ENV, "1")
    assert emulation.load() is None
    yield


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
