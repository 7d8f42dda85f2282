"""The CUDA Block step (csrc/cuda/block_step_kernels.cuh) on CPU tensors under the SIMT
harness (ATTNRES_CUDA_EMULATE=1): the very kernel code nvcc compiles, with the launch
configuration of the real build, against the reference (FlashAttention's rule), fp64
gradcheck, opcheck, bitwise determinism, and the exact global-memory traffic of one
forward and one backward. Shapes stay tiny: every CUDA thread is a fiber."""

import itertools

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.cuda import emulation
from tests.ops.test_block_step import (
    MIXES,
    OUTPUT_NAMES,
    _gradcheck_inputs,
    _op_samples,
    _with_absent,
    compare_step,
    make_step,
    step_with_grads,
    stepper,
)
from tests.support import attnres_ops_called

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
LAYOUTS = ("contiguous", "strided", "transposed")


pytestmark = pytest.mark.usefixtures("cuda_emulation")


def kernels_run():
    return [x.kernel for x in emulation.launch_log()]


def _grid():
    """dtype × D with leading dims, layouts, the optional partial / out norm / lse cycling."""
    cases = []
    for k, (dtype, d) in enumerate(itertools.product(DTYPES, (1, 7, 100, 1000))):
        lead = ((3,), (2, 5), (4, 3))[k % 3] if d < 1000 else ((2,), (1, 3))[k % 2]
        layout = LAYOUTS[k % 3] if len(lead) > 1 else LAYOUTS[k % 2]
        has_partial, out_norm, return_lse = k % 2 == 0, (k // 2) % 2 == 0, k % 3 != 1
        case_id = f"{dtype}-D{d}-{lead}-{layout}-partial{int(has_partial)}-norm{int(out_norm)}"
        cases.append(pytest.param(dtype, d, lead, layout, has_partial, out_norm, return_lse, id=case_id))
    return cases


@pytest.mark.parametrize("dtype,d,lead,layout,has_partial,out_norm,return_lse", _grid())
def test_matches_reference(dtype, d, lead, layout, has_partial, out_norm, return_lse):
    inputs = make_step(lead, d, dtype if has_partial else None, dtype, dtype, layout, out_norm)
    compare_step("cuda", inputs, return_lse)
    kernels = kernels_run()
    assert any(k.startswith("block_step_fwd<") for k in kernels), kernels
    assert any(k.startswith("block_step_bwd<") for k in kernels), kernels
    assert any(k.endswith("[norm]") for k in kernels) == out_norm, kernels


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixed_dtypes_match_reference(mix):
    """Each tensor is read and written in its own dtype, as the CPU op does."""
    partial_dtype, update_dtype, prefix_dtype = MIXES[mix]
    inputs = make_step((2, 3), 37, partial_dtype, update_dtype, prefix_dtype, "strided", out_norm=True)
    compare_step("cuda", inputs)


def test_widest_row_matches_reference():
    """D = 4096 (the kernels' limit: 512 threads × 2 groups of 4 fp32), two rows, by the same rule
    against the fp64 oracle as the narrow rows (a direct fp32 comparison with the C++ CPU op, which
    sums 4096 elements in another order, flaked at a gradient element near 0)."""
    inputs = make_step((2,), 4096, torch.float32, torch.float32, torch.float32, out_norm=True)
    compare_step("cuda", inputs, return_lse=False)
    assert {"block_step_fwd<float, G=4, K=2>", "block_step_bwd<float, G=4, K=2>[norm]"} <= set(kernels_run())


def test_too_wide_rows_are_refused_clearly():
    d = 4097
    x = torch.randn(2, d)
    with pytest.raises(ak.BackendUnavailableError, match="D <= 4096"):
        ak.block_step(x, x, torch.zeros(d), x, torch.zeros(2), backend="cuda")
    with pytest.raises(ValueError, match="D <= 4096"):
        torch.ops.attnres_emu.block_step_fwd(x, x, torch.zeros(d), None, x, torch.zeros(2), None, 1e-6, None)


@pytest.mark.parametrize("has_partial,out_norm", [(True, True), (False, False), (True, False), (False, True)])
def test_gradcheck_fp64(has_partial, out_norm):
    """Every differentiable input through every output (new_partial, out, lse)."""
    inputs = _gradcheck_inputs(has_partial, d=5, lead=(3,))
    if not out_norm:
        inputs[6] = None
    bind, present = _with_absent(inputs)
    assert torch.autograd.gradcheck(bind(stepper("cuda")), present)


def test_gradgradcheck_fp64():
    """Double backward (autograd through the reference) on top of the CUDA forward."""
    bind, present = _with_absent(_gradcheck_inputs(True, d=4, lead=(2,)))
    assert torch.autograd.gradgradcheck(bind(stepper("cuda")), present, fast_mode=True)


@pytest.mark.parametrize("used", OUTPUT_NAMES)
def test_gradients_with_unused_outputs(used):
    """Absent incoming gradients (grad_new_partial, grad_out, grad_lse): the reference's gradients."""
    inputs = _gradcheck_inputs(True, d=6, lead=(3,))
    index = OUTPUT_NAMES.index(used)
    weight = torch.randn_like(stepper("reference")(*inputs)[index])
    got, want = (
        torch.autograd.grad((stepper(b)(*inputs)[index] * weight).sum(), inputs, materialize_grads=True)
        for b in ("cuda", "reference")
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_opcheck():
    op = torch.ops.attnres_emu
    for args in _op_samples():
        torch.library.opcheck(op.block_step_fwd.default, args)
    partial, update, w, g, h_a, lse_a, g_out, eps, key_rank = [
        x.detach() if torch.is_tensor(x) else x for x in _op_samples()[0]
    ]
    new, out, lse, logit, rinv = op.block_step_fwd.default(partial, update, w, g, h_a, lse_a, g_out, eps, key_rank)
    for grads in (
        (torch.randn_like(new), torch.randn_like(out), torch.randn_like(lse)),
        (None, torch.randn_like(out), None),
    ):
        torch.library.opcheck(
            op.block_step_bwd.default, (*grads, new, w, g, h_a, lse_a, g_out, logit, rinv, eps, key_rank)
        )


def test_the_emulated_ops_ran_not_the_reference():
    inputs = _gradcheck_inputs(True)

    def step():
        new, out = stepper("cuda", return_lse=False)(*inputs)
        (new.sum() + out.sum()).backward()

    called = attnres_ops_called(step)
    assert {"attnres_emu::block_step_fwd", "attnres_emu::block_step_bwd"} <= called, called


def test_backward_is_bitwise_deterministic():
    """Same bits on every run: the weight gradients are per-chunk partials (300 rows:
    19 chunks of 16) summed in chunk order, no atomics."""
    inputs = make_step((300,), 24, torch.float32, torch.bfloat16, torch.float32)
    out_weights = [torch.randn(300, 24, dtype=torch.float64) for _ in range(2)]
    runs = [step_with_grads(stepper("cuda", return_lse=False), inputs, out_weights) for _ in range(2)]
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert (a is None and b is None) or torch.equal(a, b)
    (launch,) = [x for x in emulation.launch_log() if x.kernel.startswith("block_step_bwd")][-1:]
    assert launch.grid[0] * launch.block[1] >= 19


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_and_inf_propagate_like_reference():
    partial, update, w, h_a, lse_a, g, g_out = make_step((5,), 8, torch.float32, torch.float32, torch.float32)
    partial[1, 2] = float("nan")
    update[3, 0] = float("inf")
    h_a[4, 4] = float("nan")
    for norm in (None, g_out):
        got = ak.block_step(partial, update, w, h_a, lse_a, g, out_norm_weight=norm, return_lse=True, backend="cuda")
        want = reference.block_step(partial, update, w, h_a, lse_a, g, out_norm_weight=norm, return_lse=True)
        for a, b in zip(got, want):
            assert torch.equal(a.isnan(), b.isnan())
            finite = ~b.isnan()
            torch.testing.assert_close(a[finite], b[finite])


def test_empty_leading_dims():
    partial, update, h_a = (torch.randn(0, 3, 8, requires_grad=True) for _ in range(3))
    new, out = ak.block_step(partial, update, torch.randn(8), h_a, torch.randn(0, 3), backend="cuda")
    assert new.shape == out.shape == (0, 3, 8)
    (new.sum() + out.sum()).backward()
    assert partial.grad.shape == update.grad.shape == h_a.grad.shape == (0, 3, 8)


# ---------------------------------------------------------------- global-memory traffic


def nbytes(t):
    return t.numel() * t.element_size()


def teams(launch):
    return launch.grid[0] * launch.grid[1] * launch.block[1]


def warps(launch):
    return launch.block[0] // 32


def assert_traffic(launch, reads, writes):
    for group, (read, written) in launch.traffic.items():
        assert read == reads.get(group, 0), (launch.kernel, group, read, reads.get(group, 0))
        assert written == writes.get(group, 0), (launch.kernel, group, written, writes.get(group, 0))
    for group in set(reads) | set(writes):  # every expected buffer was touched as claimed
        assert launch.traffic.get(group, (0, 0)) == (reads.get(group, 0), writes.get(group, 0)), group


@pytest.mark.parametrize(
    "dtypes,d,out_norm",
    [
        ((torch.bfloat16, torch.bfloat16, torch.float32), 64, True),  # vector path, mixed dtypes
        ((None, torch.float32, torch.float32), 37, False),  # no partial; unaligned rows: element loads
        ((torch.float32, torch.float16, torch.float64), 640, True),  # fp64 math, three warps per row
    ],
)
def test_one_pass_over_each_row(dtypes, d, out_norm):
    """Forward: each addend and prefix element read once, new_partial and out written once,
    the per-row scalars once (lse_a once per warp), query, norm_weight (out_norm_weight)
    read once per row team. Backward: new_partial, h_a and the incoming row gradients read
    once, both row gradients written once, one du (dg) partial per row chunk, which
    site_grads reads once to write the parameters' gradients once."""
    partial_dtype, update_dtype, prefix_dtype = dtypes
    m = 40  # three row chunks of 16 in the backward
    partial, update, w, h_a, lse_a, g, g_out = make_step((5, 8), d, partial_dtype, update_dtype, prefix_dtype)
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in (partial, update, h_a)]
    new, out, lse = ak.block_step(
        leaves[0], leaves[1], w, leaves[2], lse_a, g, out_norm_weight=g_out if out_norm else None, return_lse=True,
        backend="cuda",
    )  # fmt: skip
    (fwd,) = emulation.launch_log()
    acc = lse.element_size()
    rows = lambda t: nbytes(t) if t is not None else 0
    assert_traffic(
        fwd,
        reads={
            "partial": rows(partial),
            "update": rows(update),
            "prefix_out": rows(h_a),
            "prefix_lse": m * acc * warps(fwd),
            "query": teams(fwd) * nbytes(w),
            "norm_weight": teams(fwd) * nbytes(g),
            "out_norm_weight": teams(fwd) * nbytes(g_out) if out_norm else 0,
        },
        writes={"new_partial": nbytes(new), "out": nbytes(out), "lse": m * acc, "logit": m * acc, "rinv": m * acc},
    )
    gen = [torch.randn(t.shape, dtype=torch.float64) for t in (new, out, lse)]
    ((new.double() * gen[0]).sum() + (out.double() * gen[1]).sum() + (lse * gen[2]).sum()).backward()
    launches = emulation.launch_log()
    (bwd,) = [x for x in launches if x.kernel.startswith("block_step_bwd")]
    (site_grads,) = [x for x in launches if x.kernel.startswith("site_grads")]
    chunks = -(-m // 16)
    w_ = warps(bwd)
    assert_traffic(
        bwd,
        reads={
            "new_partial": nbytes(new),
            "prefix_out": rows(h_a),
            "grad_out": nbytes(out),  # out's gradient, in out's dtype
            "grad_new_partial": nbytes(new),
            "grad_lse": m * acc * w_,
            "logit": m * acc * w_,
            "rinv": m * acc * w_,
            "prefix_lse": m * acc * w_,
            "query": chunks * nbytes(w),  # once per row chunk
            "norm_weight": chunks * nbytes(g),
            "out_norm_weight": chunks * nbytes(g_out) if out_norm else 0,
        },
        writes={
            "grad_total": nbytes(new),
            "grad_prefix_out": rows(h_a),
            "grad_prefix_lse": m * acc,
            "du_part": chunks * d * acc,
            "dg_part": chunks * d * acc if out_norm else 0,
        },
    )
    assert_traffic(
        site_grads,
        reads={
            "du_part": chunks * d * acc,
            "dg_part": chunks * d * acc if out_norm else 0,
            "query": nbytes(w),
            "norm_weight": nbytes(g),
        },
        writes={
            "grad_query": nbytes(w),
            "grad_norm_weight": nbytes(g),
            "grad_out_norm_weight": nbytes(g_out) if out_norm else 0,
        },
    )
    assert [x.kernel for x in launches if x is not site_grads and x is not bwd] == []
